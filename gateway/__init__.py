"""The gateway: the one door of the system (``fleetbatch gateway serve`` / ``fleetbatch gateway up``).

It validates batches submitted over gRPC (:mod:`gateway.checks.validation`), predicts each query's
response length, assigns queries to clusters at token granularity (:mod:`gateway.assign.policies`)
and enqueues them in Redis through :mod:`workqueue`; it streams results back, runs the
backoff offloader (:mod:`gateway.offload.moves`, :mod:`gateway.offload.offloader`) and the admin API
(:mod:`gateway.grpc_api.admin`: rebalance, drain, add, remove). Every call is authenticated (client
Bearer tokens and the admin token, :mod:`gateway.grpc_api.auth`) and bounded (:mod:`gateway.batches.limits`).
It never talks to an engine directly:
the gateway and the engines meet only in :mod:`workqueue` and :mod:`protos`.
"""
