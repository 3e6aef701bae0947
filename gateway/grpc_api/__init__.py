"""The gRPC front: the batch service's servicer, the admin API, authentication by client tokens, interceptors (Redis down, undecodable requests) and TLS."""
