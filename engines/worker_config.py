"""How a cluster's worker runs: its queue's leases and ticks, and its emulated device."""

from __future__ import annotations

from dataclasses import dataclass

import redis

from engines.device import StepCost

#: errors after which Redis may answer again (down, restarting, loading its data)
REDIS_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)


@dataclass
class WorkerConfig:
    cluster: str
    lease_s: float = 15.0
    heartbeat_s: float = 1.0
    heartbeat_ttl_s: float = 5.0
    idle_poll_s: float = 0.05  # an empty queue is asked again after this, doubling up to idle_poll_max_s
    idle_poll_max_s: float = 0.5
    cancel_check_s: float = 0.5  # batches' statuses and the cluster's state are read at least this often
    requeue_check_s: float = 2.0
    # Claim ahead: besides what the engine can take now, the queue agent holds queries for the next
    # three ticks (a tick is a round trip to Redis) at the engine's measured rate, by predicted
    # tokens, for at most claim_ahead_s and a third of the lease, and at most max_ahead queries
    claim_ahead_s: float = 2.0
    max_ahead: int = 64
    min_tick_s: float = 0.005  # the agent's ticks come at most this often (finished results go together)
    backend: str = "static"
    # the model's name rows may ask for ("": any), and the OpenAI fields its backend passes through
    # (workqueue.openai_body): both registered, so the gateway refuses at submission what it cannot run
    served_model: str = ""
    openai_fields: frozenset[str] = frozenset()
    # the key its answers' lengths are kept under (workqueue.length_stats.length_model_key; "": not kept)
    length_model: str = ""
    capacity_hint_tps: float = 0.0
    plan_tps: float = 0.0
    max_query_tokens: int = 0
    redis_backoff_max_s: float = 5.0  # longest wait between retries while Redis is unreachable
    # Emulated device: each step lasts (1 + slowdown) x its compute time, sleeping the rest. Compute
    # time is the process's CPU time (wall time when threads ran in parallel), so a busy shared CPU,
    # which stretches wall time but not CPU time, does not slow the emulated device down.
    slowdown: float = 0.0
    # Emulated device by cost model (engines.device): each step lasts what its forward passes cost on
    # the modelled device (its compute, when that took longer: an overrun), whatever this CPU's speed
    device_cost: StepCost | None = None
    # An emulated device's step starts where its last one ended when the host comes back within this
    # many seconds: the host's bookkeeping between steps overlaps the device's work (Worker._emulate_device)
    host_overlap_s: float = 0.002
    record_observed: bool = True
    # a running query's partial output is written every this many tokens (engines.checkpoints; 0: never), so a hard
    # kill loses at most that many of its tokens; engines that cannot resume (vllm, endpoint, static) write none
    checkpoint_tokens: int = 64

    @property
    def renew_every_s(self) -> float:
        """How often leases are renewed and the heartbeat is published."""
        return max(0.05, min(self.heartbeat_s, self.lease_s / 3))
