"""``load.chaos``: fault injection on a real deployment (`fleetbatch loadgen chaos`): the run, its faults, their evidence, its books."""
