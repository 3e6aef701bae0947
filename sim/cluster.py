"""One simulated cluster: what it is (:class:`ClusterSpec`) and its state while the simulation runs (:class:`SimCluster`:
its queue, its engine, what the gateway would read of it, and its figures at the end)."""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.assign.policies import ClusterView
from sim.costs import LinearCost
from sim.queues import OrderedQueue


@dataclass(frozen=True)
class ClusterSpec:
    """One simulated cluster: its cost model, engine kind and engine limits."""

    name: str
    cost: LinearCost = field(default_factory=LinearCost)  # unused by "pipelined" (its plan's devices)
    backend: str = "iteration"  # "iteration" (native scheduler), "static" or "pipelined" (with plan)
    batch: int = 8  # max_running (iteration) or max_batch (static); a plan sets its own
    kv_budget_tokens: int = 16384
    capacity_tps: float | None = None  # capacity hint; None: from the cost model and the workload's means
    plan: str | None = None  # "pipelined": the plan file its stages run (sim.pipelined)


class SimCluster:
    """A cluster while the simulation runs: its queue, its engine and the counts :class:`sim.core.Simulator` keeps."""

    def __init__(self, spec: ClusterSpec, engine, capacity: float) -> None:
        self.spec = spec
        self.name = spec.name
        self.engine = engine
        self.capacity = capacity
        self.queue = OrderedQueue()
        self.queued_tokens = 0.0  # prompt + predicted of queued queries (Redis "pending")
        self.inflight_pred = 0.0  # predicted tokens of queries the engine holds (heartbeat)
        self.busy = False
        self.step_start = 0.0
        self.version = 0
        self.finished = 0
        self.failed = 0
        self.moved_in = 0
        self.moved_out = 0
        self.busy_s = 0.0
        self.down = False  # preempted or killed, until it is back (sim.spot): it takes no work

    def view(self) -> ClusterView:
        pending = max(0.0, self.queued_tokens + self.inflight_pred)
        return ClusterView(self.name, self.capacity, pending_tokens=pending, queue_length=len(self.queue))

    def summary(self) -> dict:
        """Its figures at the end of a run (:attr:`sim.result.SimResult.per_cluster`)."""
        e = self.engine
        return {
            "queries": self.finished,
            "failed": self.failed,
            "steps": e.num_steps,
            "generated_tokens": e.generated_tokens,
            "busy_s": round(self.busy_s, 3),
            "kv_token_seconds": round(e.kv_token_seconds, 1),
            "kv_cached_token_seconds": round(e.kv_cached_token_seconds, 1),
            "moved_in": self.moved_in,
            "moved_out": self.moved_out,
            "capacity_tps": round(self.capacity, 2),
            **{k: getattr(e.kv, k, 0) for k in ("hit_tokens", "lookup_tokens") if hasattr(e, "kv")},
            "prefill_tokens": getattr(e, "prefill_tokens", 0),
        }
