"""The OpenAI-compatible HTTP front: /v1/files and /v1/batches over the batch service, its own key and error mapping, the output files' finalizer and retention, and the status page."""
