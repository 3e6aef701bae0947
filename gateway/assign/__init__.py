"""Assignment: which cluster gets each query. The policies (round robin, token, prefix-aware), the clusters as assignment sees them (capacity, views, listing, placement) and prompt token bounds."""
