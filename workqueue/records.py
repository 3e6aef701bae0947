"""The records the queue reads and writes: queries as enqueued and claimed, batch and cluster views."""

from __future__ import annotations

from dataclasses import dataclass, field

from workqueue import keys

FINAL_STATES = ("completed", "failed", "cancelled")


@dataclass
class QueuedQuery:
    """One query as the gateway enqueues it (``payload`` is what the engine needs)."""

    batch_id: str
    query_id: str
    prompt: str
    max_tokens: int
    prompt_tokens: int
    predicted_tokens: float
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    forced_length: int | None = None
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def gid(self) -> str:
        return keys.gid(self.batch_id, self.query_id)

    @property
    def total_tokens(self) -> float:
        return self.prompt_tokens + self.predicted_tokens


@dataclass
class ClaimedQuery:
    query: QueuedQuery
    attempts: int
    enqueued_at: float
    claimed_at: float


@dataclass
class BatchInfo:
    batch_id: str
    status: str
    total: int
    completed: int
    failed: int
    cancelled: int
    created_at: float
    completed_at: float
    policy: str = ""
    metadata: dict[str, str] = field(default_factory=dict)
    queries_per_cluster: dict[str, int] = field(default_factory=dict)
    predicted_tokens_per_cluster: dict[str, float] = field(default_factory=dict)
    fingerprint: str = ""  # digest of the submitted queries: a retry with other queries is refused

    @property
    def final(self) -> bool:
        return self.status in FINAL_STATES


@dataclass
class ClusterInfo:
    """Everything the gateway knows about one cluster: config, last heartbeat, queue state, counters."""

    name: str
    state: str = "active"  # active | draining | removed
    backend: str = ""
    capacity_hint_tps: float = 0.0
    plan_tps: float = 0.0
    max_query_tokens: int = 0
    kv_budget_tokens: int = 0
    alive: bool = False
    last_heartbeat: float = 0.0
    measured_tps: float = 0.0
    running: int = 0
    waiting: int = 0
    kv_used_tokens: int = 0
    kv_total_tokens: int = 0
    kv_step_tokens: int = 0  # KV the engine held during its last step
    kv_token_seconds: float = 0.0  # the engine's KV tokens x seconds since it started (MICO's cumulative KV)
    running_remaining_tokens: float = 0.0
    queue_length: int = 0
    inflight: int = 0
    pending_tokens: float = 0.0
    assigned_predicted_tokens: float = 0.0
    finished_predicted_tokens: float = 0.0
    finished_actual_tokens: int = 0
    finished_queries: int = 0

    @property
    def accepting(self) -> bool:
        return self.state == "active"

    @property
    def kv_free_tokens(self) -> int:
        return max(0, self.kv_total_tokens - self.kv_used_tokens)


def as_float(v, default: float = 0.0) -> float:
    """``v`` as a float (``default`` for None or junk): Redis hashes hold strings."""
    try:
        return float(v) if v is not None else default
    except (TypeError, ValueError):
        return default


def as_int(v, default: int = 0) -> int:
    return int(as_float(v, default))
