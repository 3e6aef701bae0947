"""What the gateway says about the fleet: each batch's ETA (eta) and the Prometheus metrics."""
