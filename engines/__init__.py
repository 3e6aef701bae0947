"""The engines: one per cluster (``fleetbatch engine serve``), turning queued queries into results.

:mod:`engines.worker` claims queries from the cluster's Redis queue under leases and writes
each result once; behind it an engine implements :class:`engines.interface.Engine`: the
native iteration-level engine (:mod:`engines.engine`: scheduler, paged KV cache, model
runner; a plan with several stages runs as processes, :mod:`engines.pipeline`), static
batching (:mod:`engines.static_engine`), vLLM on a GPU (:mod:`engines.vllm_engine`, its arguments
:mod:`engines.vllm_backend`) or inference
servers the user already runs (:mod:`engines.endpoint_backend`). Its queue agent
(:mod:`engines.queue_agent`) does the Redis work; :mod:`engines.checkpoints` keeps the running
queries' partial outputs in Redis and handles a preemption notice; the native engine and vLLM resume one from
its tokens (:mod:`engines.partials`), the endpoint backend from its text (:mod:`engines.endpoint_job`).
Engines know the gateway only through :mod:`workqueue` and :mod:`protos`.
"""
