"""The shared data layer at the bottom: readers for the real prompt/response datasets in
``../shared/data`` (``$FLEETBATCH_DATA``) and generic JSONL (:mod:`fleetdata.datasets`).
Used by the predictor, quant, the engines' benchmarks, load and the simulator; it imports
nothing of the project."""
