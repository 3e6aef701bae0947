"""The phase-aware planner (``fleetbatch planner plan``): how one cluster of unlike devices serves a model.

An OR-Tools ILP (:mod:`planner.ilp`, driven by :mod:`planner.search`) chooses the layer
partition over the cluster's devices, the bits of each layer and the prefill and decode
micro-batch sizes, from device profiles (:mod:`planner.profiler`, :mod:`planner.latency`)
and exact memory (:mod:`planner.memory`). Its output is a plan file (:mod:`planfile`)
that engines execute.
"""
