"""The records the queue reads and writes, shared by the gateway and the engines.

* states: :class:`QueryState` (a query's hash, and how it finished) and :class:`BatchState`
  (a batch's ``status``), string enums whose values are what Redis holds;
* queries as enqueued (:class:`QueuedQuery`) and claimed (:class:`ClaimedQuery`);
* what a finished query leaves: its :class:`QueryResult` (in the batch's results list), its
  :class:`Outcome` (decided by :func:`outcome` alone) and, when it was answered, an
  :class:`Observation` (``fb:observed``, for predictor retraining);
* the batch and cluster views (:class:`BatchInfo`, :class:`ClusterInfo`).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from workqueue import keys
from workqueue.partial import Partial


class QueryState(enum.StrEnum):
    """A query's ``state`` in its hash; the last three are also how it finished (``complete``'s kind)."""

    QUEUED = "queued"
    RUNNING = "running"
    CANCELLING = "cancelling"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


class BatchState(enum.StrEnum):
    """A batch's ``status``: ``validating`` while the background intake stores its rows; ``expiring`` once its
    deadline passed (its unfinished queries are being stopped), then ``expired`` (final)."""

    VALIDATING = "validating"
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"
    EXPIRING = "expiring"
    EXPIRED = "expired"


class Outcome(enum.StrEnum):
    """How a finished query came out, decided by :func:`outcome` alone: a real answer that ended on
    its own (``completed``) or at its token limit (``truncated``), ``failed`` or ``cancelled``."""

    COMPLETED = "completed"
    TRUNCATED = "truncated"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def state(self) -> QueryState:
        """The final :class:`QueryState` it counts as in its batch (a truncated answer is completed)."""
        return QueryState.COMPLETED if self is Outcome.TRUNCATED else QueryState(self.value)

    @property
    def answered(self) -> bool:
        """A real answer: it goes to the output file, and is an observation of the response length."""
        return self in (Outcome.COMPLETED, Outcome.TRUNCATED)


def outcome(finish_reason: str | None, error: str | None = None) -> Outcome:
    """The one rule for a result's outcome, from its ``finish_reason`` and ``error``: cancelled
    (``cancelled``, ``abort``, ``batch_expired``: its batch's window ended first), failed (``error``, or any result that carries an error, such as a
    query the KV cache cannot hold), truncated (``length``), else completed (``stop``)."""
    reason = finish_reason or ""
    if reason in ("cancelled", "abort", "batch_expired"):
        return Outcome.CANCELLED
    if error or reason == "error":
        return Outcome.FAILED
    return Outcome.TRUNCATED if reason == "length" else Outcome.COMPLETED


#: how a query can finish (the kinds :meth:`WorkQueue.complete` takes)
FINAL_QUERY_STATES = frozenset({QueryState.COMPLETED, QueryState.FAILED, QueryState.CANCELLED})
#: the batch statuses nothing changes any more
FINAL_BATCH_STATES = frozenset(
    {BatchState.COMPLETED, BatchState.FAILED, BatchState.CANCELLED, BatchState.EXPIRED}
)
#: a batch cancelled or being cancelled: no more of its queries are enqueued
CANCELLED_BATCH_STATES = frozenset({BatchState.CANCELLING, BatchState.CANCELLED})
#: a batch that stops (cancelled, or its window ended): its queued queries are dropped, running ones aborted
STOPPING_BATCH_STATES = CANCELLED_BATCH_STATES | {BatchState.EXPIRING, BatchState.EXPIRED}
#: final states of queries and batches alike (the members are equal strings: three of them)
FINAL_STATES = FINAL_QUERY_STATES | FINAL_BATCH_STATES


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
    cached_tokens: int = (
        0  # prompt tokens its cluster's prefix cache is expected to hold (gateway.assign.prefix_policy)
    )
    # the OpenAI request it came from (workqueue.openai_body): a chat's messages, fields passed through
    openai_body: dict[str, Any] | None = None
    # its tenant's salt of the engine's prefix-cache keys (gateway.intake.rows.tenant_salt; "": one shared cache)
    cache_salt: str = ""
    # the predictor's own estimate of its answer before calibration (None: the same as predicted_tokens); what its
    # observed length is compared with (workqueue.length_stats)
    raw_predicted_tokens: float | None = None

    @property
    def gid(self) -> str:
        return keys.gid(self.batch_id, self.query_id)

    @property
    def total_tokens(self) -> float:
        return self.prompt_tokens + self.predicted_tokens

    @property
    def charged_tokens(self) -> float:
        """What it adds to its cluster's ``pending``: its tokens less those its prefix cache holds."""
        return self.total_tokens - self.cached_tokens


@dataclass
class ClaimedQuery:
    query: QueuedQuery
    attempts: int
    enqueued_at: float
    claimed_at: float
    partial: Partial | None = None  # what an earlier run generated (workqueue.partial): resume from it


@dataclass
class BatchInfo:
    """A batch as its hash holds it; ``status`` is a :class:`BatchState` value."""

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
    error: str = ""  # what failed the batch as a whole (its intake list lost), if anything
    deadline: float = 0.0  # when it expires (unix seconds, the gateway's clock); 0: never
    priority: int = 0
    order_key: float = 0.0  # its place in every queue (workqueue.ordering): lowest runs first
    done_predicted_tokens: float = 0.0  # predicted tokens (prompt + response) of its answered queries
    done_actual_tokens: int = 0  # their actual tokens (prompt + completion)
    #: predicted tokens of its unfinished queries, by cluster; rows the background intake has not enqueued yet
    left_tokens_per_cluster: dict[str, float] = field(default_factory=dict)
    intake_left: int = 0

    @property
    def predicted_tokens(self) -> float:
        """Predicted tokens (prompt + response) of its enqueued queries."""
        return float(sum(self.predicted_tokens_per_cluster.values()))

    @property
    def final(self) -> bool:
        return self.status in FINAL_BATCH_STATES


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
    device_steps: int = (
        0  # steps on an emulated device (fleetbatch engine serve --device-cost) since it started
    )
    device_overrun_steps: int = 0  # of those, the steps whose real compute outlasted the modelled time
    # cumulative since the engine started; None from an engine that does not report them
    device_busy_s: float | None = None  # seconds spent in steps, emulated device time included
    steps: int | None = None  # engine steps
    redis_round_trips: int | None = None  # round trips of the worker's queue client (workqueue.roundtrips)
    running_remaining_tokens: float = 0.0
    queue_length: int = 0
    inflight: int = 0
    pending_tokens: float = 0.0
    assigned_predicted_tokens: float = 0.0
    finished_predicted_tokens: float = 0.0
    finished_actual_tokens: int = 0
    finished_total_tokens: int = 0  # prompt + completion tokens of its answered queries
    finished_queries: int = 0
    # what its worker registered (None: no worker has yet): the model's name rows may ask for ("": any)
    # and the OpenAI fields it passes through (comma-separated, workqueue.openai_body)
    served_model: str | None = None
    openai_fields: str | None = None
    # the key of its model's answer lengths (workqueue.length_stats; None: no worker registered one)
    length_model: str | None = None

    @property
    def accepting(self) -> bool:
        return self.state == "active"

    @property
    def kv_free_tokens(self) -> int:
        return max(0, self.kv_total_tokens - self.kv_used_tokens)


@dataclass
class Timings:
    """When a query was enqueued, claimed, gave its first token and finished (Unix seconds)."""

    enqueued_at: float = 0.0
    started_at: float = 0.0
    first_token_at: float | None = 0.0
    finished_at: float = 0.0

    def to_dict(self) -> dict[str, float | None]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Timings:
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})


@dataclass
class QueryResult:
    """One finished query's result, as a worker, the gateway or a queue script writes it.

    A field left None is absent from the JSON: a worker's result carries every field but
    ``index``, while the failures the gateway and the scripts write (an invalid query, a
    cancelled or given-up one) carry only ids, ``finish_reason``, ``error`` and at most
    ``cluster`` and ``attempts``. The JSON keeps the field order, so :meth:`to_json` writes
    what the producers always wrote and ``from_json(s).to_json() == s`` for it. ``index``
    (the position in the batch's results) is not stored: readers set it.
    """

    batch_id: str
    query_id: str
    text: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cluster: str | None = None
    timings: Timings | None = None
    finish_reason: str | None = None  # stop | length | abort | error | cancelled
    error: str | None = None
    predicted_tokens: float | None = None
    attempts: int | None = None
    index: int | None = None
    # what an endpoint answered beyond the text: "logprobs", "tool_calls" (workqueue.openai_body)
    openai_extra: dict[str, Any] | None = None

    @property
    def outcome(self) -> Outcome:
        return outcome(self.finish_reason, self.error)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if v is not None:
                out[f.name] = v.to_dict() if isinstance(v, Timings) else v
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> QueryResult:
        """The result in ``d`` (missing ids read as ``""``, unknown keys are ignored)."""
        kw = {f.name: d[f.name] for f in fields(cls) if d.get(f.name) is not None}
        if "timings" in kw:
            kw["timings"] = Timings.from_dict(kw["timings"])
        kw.setdefault("batch_id", "")
        kw.setdefault("query_id", "")
        return cls(**kw)

    @classmethod
    def from_json(cls, s: str | bytes) -> QueryResult:
        return cls.from_dict(json.loads(s))


@dataclass
class Observation:
    """A completed query's (prompt, length) for predictor retraining (one element of ``fb:observed``).

    ``length`` is its completion tokens in the serving tokenizer, ``predicted`` the predictor's own estimate
    for it, before calibration (None when unknown). ``retrain`` false: its pair only counts in its length
    model's statistics (:mod:`workqueue.length_stats`), it is not kept for retraining (a recorded length
    forced on the engine, or a worker told not to record prompts); it is not part of the record.
    """

    prompt: str
    length: int
    source: str = ""
    cluster: str = ""
    predicted: float | None = None
    retrain: bool = True

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        del d["retrain"]
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Observation:
        """Raises KeyError, TypeError or ValueError when ``d`` has no prompt or no integer length."""
        return cls(
            d["prompt"], int(d["length"]), d.get("source", ""), d.get("cluster", ""), d.get("predicted")
        )

    @classmethod
    def from_json(cls, s: str | bytes) -> Observation:
        return cls.from_dict(json.loads(s))


def as_float(v, default: float = 0.0) -> float:
    """``v`` as a float (``default`` for None or junk): Redis hashes hold strings."""
    try:
        return float(v) if v is not None else default
    except (TypeError, ValueError):
        return default


def as_int(v, default: int = 0) -> int:
    return int(as_float(v, default))


def as_opt_int(v) -> int | None:
    """``v`` as an int, None when absent or junk (a figure an older engine does not report)."""
    f = as_float(v, None)
    return None if f is None else int(f)
