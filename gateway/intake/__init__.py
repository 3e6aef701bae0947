"""The background intake: large batches accepted at once, predicted, assigned and enqueued in chunks (background), their chunks (chunks) and stored rows (rows)."""
