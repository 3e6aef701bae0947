"""Discrete-event simulator of a fleetbatch fleet in cost-model time, driving the real code.

What runs for real (imported from the project, not copied):

* assignment: :mod:`gateway.assign.policies` (``round_robin``, the capacity-weighted ``token`` policy)
  on :class:`~gateway.assign.policies.ClusterView` / :class:`~gateway.assign.policies.QueryLoad`, as
  :mod:`gateway.batches.service` calls it;
* backoff offloading: :func:`gateway.offload.moves.plan_offload` and :class:`gateway.offload.moves.Backoff`
  with the simulator's clock, ticked like :class:`gateway.offload.offloader.Offloader`;
* iteration-level engines: :class:`engines.scheduler.Scheduler` with
  :class:`engines.kv_cache.KVCacheManager` and :class:`engines.sequence.Sequence`, pulled like
  :mod:`engines.worker` does with the real ``LLMEngine.free_slots``;
* static batching: the batch choice and ``free_slots`` of :class:`engines.static_engine.StaticBatchEngine`.

What is modelled: the time a step takes (:mod:`sim.costs`: a linear per-cluster cost model,
or one linearised from a fleetbatch planner profile), the model's tokens (forced lengths), Redis (plain
per-cluster deques) and the network (moves are instant; their cost enters only the decision).

Modules: :mod:`sim.costs` (step times), :mod:`sim.workload` (queries and arrivals),
:mod:`sim.engines` (simulated engines around the real scheduler), :mod:`sim.pipelined` (a planned
cluster: the plan's pipeline stages on their devices' cost models), :mod:`sim.cluster` (a cluster's
spec and state), :mod:`sim.core` (the event loop), :mod:`sim.spot` (prices, preemptions and resumes;
:mod:`sim.spot_replay`, :mod:`sim.spot_scale`), :mod:`sim.study` (MICO's four combinations, the cluster sweep, the scale run) and
:mod:`sim.cli` (the ``fleetsim`` command: ``fleetbatch sim study|scale``; ``python -m sim.cli`` too). See ``docs/design/sim.md``.
"""
