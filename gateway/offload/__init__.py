"""Offloading and rebalancing: the moves between clusters' queues (moves), the offloader's tick (offloader) and `fleetbatch gateway rebalance`'s plan (rebalance)."""
