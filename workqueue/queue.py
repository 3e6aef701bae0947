"""Typed API over the Redis schema: batches, per-cluster queues, leases, results, heartbeats.

Delivery is at-least-once with write-once results: a worker *claims* queries (they move
from the cluster's queue into its in-flight set with a lease deadline), renews the lease
while it works, and *completes* each query once. A worker that dies stops renewing; its
leases expire and :meth:`WorkQueue.requeue_expired` puts those queries back at the head
of the queue. A second completion of the same query id is ignored, so a query that ran
twice still has exactly one result. A late completion, by a worker whose lease lapsed after
its query was requeued, counts and takes the query back out of its queue and its tokens out
of the cluster's ``pending`` counter.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

import redis

from workqueue import keys, scripts

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


def _f(v, default: float = 0.0) -> float:
    try:
        return float(v) if v is not None else default
    except (TypeError, ValueError):
        return default


def _i(v, default: int = 0) -> int:
    return int(_f(v, default))


class WorkQueue:
    """All queue operations on one Redis connection (thread-safe: redis-py pools connections)."""

    def __init__(self, client: redis.Redis):
        self.r = client
        self._complete = client.register_script(scripts.COMPLETE)
        self._claim = client.register_script(scripts.CLAIM)
        self._requeue = client.register_script(scripts.REQUEUE_EXPIRED)
        self._move_tail = client.register_script(scripts.MOVE_TAIL)
        self._cancel = client.register_script(scripts.CANCEL)

    @classmethod
    def from_url(cls, url: str) -> WorkQueue:
        return cls(redis.Redis.from_url(url, decode_responses=True))

    # ------------------------------------------------------------------ clusters

    def register_cluster(
        self,
        name: str,
        *,
        capacity_hint_tps: float | None = None,
        plan_tps: float | None = None,
        backend: str | None = None,
        max_query_tokens: int | None = None,
        kv_budget_tokens: int | None = None,
        state: str | None = None,
    ) -> None:
        if not name or ":" in name:
            raise ValueError(f"bad cluster name {name!r}: must be non-empty and contain no ':'")
        fields = {
            "capacity_hint_tps": capacity_hint_tps,
            "plan_tps": plan_tps,
            "backend": backend,
            "max_query_tokens": max_query_tokens,
            "kv_budget_tokens": kv_budget_tokens,
            "state": state,
        }
        mapping = {k: v for k, v in fields.items() if v is not None}
        pipe = self.r.pipeline(transaction=True)
        pipe.sadd(keys.CLUSTERS, name)
        pipe.hsetnx(keys.cluster_info(name), "state", "active")
        if mapping:
            pipe.hset(keys.cluster_info(name), mapping=mapping)
        pipe.execute()

    def set_cluster_state(self, name: str, state: str) -> None:
        if state not in ("active", "draining", "removed"):
            raise ValueError(f"unknown cluster state {state!r}")
        self.r.hset(keys.cluster_info(name), "state", state)

    def cluster_state(self, name: str) -> str:
        """``active``, ``draining`` or ``removed`` (``active`` for a cluster never configured)."""
        return self.r.hget(keys.cluster_info(name), "state") or "active"

    def remove_cluster(self, name: str) -> None:
        pipe = self.r.pipeline(transaction=True)
        pipe.srem(keys.CLUSTERS, name)
        pipe.delete(keys.cluster_info(name), keys.heartbeat(name), keys.pending(name))
        pipe.execute()

    def cluster_names(self) -> list[str]:
        return sorted(self.r.smembers(keys.CLUSTERS))

    def heartbeat(self, name: str, ttl_s: float, **fields: float | int | str) -> None:
        """Publish a worker's heartbeat; the cluster counts as alive until ``ttl_s`` passes without one."""
        now = time.time()
        pipe = self.r.pipeline(transaction=True)
        pipe.sadd(keys.CLUSTERS, name)
        pipe.hsetnx(keys.cluster_info(name), "state", "active")
        pipe.hset(keys.cluster_info(name), "last_seen", now)
        pipe.hset(keys.heartbeat(name), mapping={"ts": now, **fields})
        pipe.pexpire(keys.heartbeat(name), max(1, int(ttl_s * 1000)))
        pipe.execute()

    def clusters(self, names: Iterable[str] | None = None) -> list[ClusterInfo]:
        names = list(names) if names is not None else self.cluster_names()
        pipe = self.r.pipeline(transaction=False)
        for n in names:
            pipe.hgetall(keys.cluster_info(n))
            pipe.hgetall(keys.heartbeat(n))
            pipe.llen(keys.queue(n))
            pipe.zcard(keys.inflight(n))
            pipe.get(keys.pending(n))
            pipe.hgetall(keys.cluster_stats(n))
        raw = pipe.execute()
        out = []
        for i, n in enumerate(names):
            info, hb, qlen, infl, pend, stats = raw[i * 6 : i * 6 + 6]
            out.append(
                ClusterInfo(
                    name=n,
                    state=info.get("state", "active"),
                    backend=hb.get("backend") or info.get("backend", ""),
                    capacity_hint_tps=_f(info.get("capacity_hint_tps") or hb.get("capacity_hint_tps")),
                    plan_tps=_f(info.get("plan_tps") or hb.get("plan_tps")),
                    max_query_tokens=_i(info.get("max_query_tokens") or hb.get("max_query_tokens")),
                    kv_budget_tokens=_i(info.get("kv_budget_tokens") or hb.get("kv_total_tokens")),
                    alive=bool(hb),
                    last_heartbeat=_f(hb.get("ts") or info.get("last_seen")),
                    measured_tps=_f(hb.get("tokens_per_s")),
                    running=_i(hb.get("running")),
                    waiting=_i(hb.get("waiting")),
                    kv_used_tokens=_i(hb.get("kv_used_tokens")),
                    kv_total_tokens=_i(hb.get("kv_total_tokens")),
                    running_remaining_tokens=_f(hb.get("running_remaining_tokens")),
                    queue_length=int(qlen),
                    inflight=int(infl),
                    pending_tokens=max(0.0, _f(pend)),
                    assigned_predicted_tokens=_f(stats.get("assigned_predicted_tokens")),
                    finished_predicted_tokens=_f(stats.get("finished_predicted_tokens")),
                    finished_actual_tokens=_i(stats.get("finished_actual_tokens")),
                    finished_queries=_i(stats.get("finished_queries")),
                )
            )
        return out

    # ------------------------------------------------------------------ batches

    def create_batch(
        self,
        batch_id: str,
        assignments: Sequence[tuple[QueuedQuery, str]],
        *,
        policy: str = "",
        metadata: Mapping[str, str] | None = None,
    ) -> bool:
        """Create the batch and enqueue every query on its cluster in one transaction.

        Returns False (and changes nothing) when a batch with this id already exists.
        """
        if ":" in batch_id or not batch_id:
            raise ValueError(f"bad batch id {batch_id!r}")
        now = time.time()
        if not self.r.hsetnx(keys.batch(batch_id), "created_at", now):
            return False
        per_cluster: dict[str, int] = {}
        per_cluster_tokens: dict[str, float] = {}
        for q, c in assignments:
            per_cluster[c] = per_cluster.get(c, 0) + 1
            per_cluster_tokens[c] = per_cluster_tokens.get(c, 0.0) + q.total_tokens
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(
            keys.batch(batch_id),
            mapping={
                "status": "in_progress" if assignments else "completed",
                "total": len(assignments),
                "completed": 0,
                "failed": 0,
                "cancelled": 0,
                "completed_at": 0 if assignments else now,
                "policy": policy,
                "metadata": json.dumps(dict(metadata or {})),
                "queries_per_cluster": json.dumps(per_cluster),
                "predicted_tokens_per_cluster": json.dumps(per_cluster_tokens),
            },
        )
        pipe.zadd(keys.BATCHES, {batch_id: now})
        for q, c in assignments:
            payload = json.dumps(asdict(q))
            pipe.hset(
                keys.query(q.gid),
                mapping={
                    "payload": payload,
                    "tokens": q.total_tokens,
                    "cluster": c,
                    "state": "queued",
                    "attempts": 0,
                    "enqueued_at": now,
                },
            )
            pipe.rpush(keys.queue(c), q.gid)
        for c, t in per_cluster_tokens.items():
            pipe.sadd(keys.CLUSTERS, c)
            pipe.hsetnx(keys.cluster_info(c), "state", "active")
            pipe.incrbyfloat(keys.pending(c), t)
            pipe.hincrbyfloat(keys.cluster_stats(c), "assigned_predicted_tokens", t)
            pipe.hincrby(keys.cluster_stats(c), "assigned_queries", per_cluster[c])
        pipe.execute()
        return True

    def batch(self, batch_id: str) -> BatchInfo | None:
        h = self.r.hgetall(keys.batch(batch_id))
        if not h or "status" not in h:
            return None
        return BatchInfo(
            batch_id=batch_id,
            status=h["status"],
            total=_i(h.get("total")),
            completed=_i(h.get("completed")),
            failed=_i(h.get("failed")),
            cancelled=_i(h.get("cancelled")),
            created_at=_f(h.get("created_at")),
            completed_at=_f(h.get("completed_at")),
            policy=h.get("policy", ""),
            metadata=json.loads(h.get("metadata") or "{}"),
            queries_per_cluster=json.loads(h.get("queries_per_cluster") or "{}"),
            predicted_tokens_per_cluster=json.loads(h.get("predicted_tokens_per_cluster") or "{}"),
        )

    def batch_status(self, batch_id: str) -> str | None:
        return self.r.hget(keys.batch(batch_id), "status")

    def batch_statuses(self, batch_ids: Iterable[str]) -> dict[str, str | None]:
        ids = list(batch_ids)
        pipe = self.r.pipeline(transaction=False)
        for b in ids:
            pipe.hget(keys.batch(b), "status")
        return dict(zip(ids, pipe.execute(), strict=True))

    def cancel_batch(self, batch_id: str) -> int:
        """Mark the batch cancelling and cancel its queued queries; returns how many were removed (-1: unknown batch)."""
        return int(self._cancel(args=[batch_id, time.time(), *self.cluster_names()]))

    def results(self, batch_id: str, start: int = 0, end: int = -1) -> list[dict]:
        """Result records from index ``start`` (each with its ``index``)."""
        rows = self.r.lrange(keys.results(batch_id), start, end)
        out = []
        for i, row in enumerate(rows):
            d = json.loads(row)
            d["index"] = start + i
            out.append(d)
        return out

    def result_count(self, batch_id: str) -> int:
        return int(self.r.llen(keys.results(batch_id)))

    # ------------------------------------------------------------------ workers

    def claim(self, cluster: str, n: int, worker_id: str, lease_s: float) -> list[ClaimedQuery]:
        """Take up to ``n`` queries from the head of the cluster's queue under a lease."""
        if n <= 0:
            return []
        now = time.time()
        flat = self._claim(args=[cluster, n, now + lease_s, worker_id, now])
        out = []
        for i in range(0, len(flat), 4):
            _, payload, attempts, enqueued_at = flat[i : i + 4]
            out.append(ClaimedQuery(QueuedQuery(**json.loads(payload)), int(attempts), _f(enqueued_at), now))
        return out

    def renew(self, cluster: str, gids: Iterable[str], lease_s: float) -> None:
        gids = list(gids)
        if gids:
            deadline = time.time() + lease_s
            self.r.zadd(keys.inflight(cluster), {g: deadline for g in gids}, xx=True)

    def release(self, cluster: str, gids: Iterable[str]) -> int:
        """Give claimed queries back now (their worker cannot finish them): their leases end and they
        return to the head of the queue, as a lapsed lease would make them. Returns how many were requeued."""
        gids = list(gids)
        if not gids:
            return 0
        self.r.zadd(keys.inflight(cluster), dict.fromkeys(gids, 0), xx=True)
        return self.requeue_expired(cluster)

    def requeue_expired(self, cluster: str) -> int:
        """Put queries whose lease expired (their worker died) back at the head of the queue."""
        return int(self._requeue(args=[cluster, time.time()]))

    def complete(self, gid: str, result: Mapping, kind: str = "completed", actual_tokens: int = 0) -> int:
        """Write a query's result once. Returns its index in the batch's results, or -1 if it already had one."""
        if kind not in FINAL_STATES:
            raise ValueError(f"kind must be one of {FINAL_STATES}, not {kind!r}")
        return int(
            self._complete(args=[gid, json.dumps(dict(result)), kind, int(actual_tokens), time.time()])
        )

    def record_observed(self, rows: Sequence[Mapping], cap: int = 1_000_000) -> None:
        """Append observed (prompt, length) records for predictor retraining; keeps the newest ``cap``."""
        if rows:
            pipe = self.r.pipeline(transaction=False)
            pipe.rpush(keys.OBSERVED, *[json.dumps(dict(r)) for r in rows])
            pipe.ltrim(keys.OBSERVED, -cap, -1)
            pipe.execute()

    # ------------------------------------------------------------------ moving work

    def move_tail(self, src: str, dst: str, n: int) -> tuple[int, float]:
        """Atomically move up to ``n`` not-yet-started queries from the back of ``src``'s queue to ``dst``'s."""
        if src == dst or n <= 0:
            return 0, 0.0
        moved, tokens = self._move_tail(args=[src, dst, n])
        return int(moved), float(tokens)

    def tail(self, cluster: str, n: int) -> list[tuple[str, float]]:
        """The last ``n`` queued query ids of a cluster (back of the queue last) with their predicted tokens."""
        gids = self.r.lrange(keys.queue(cluster), -n, -1) if n > 0 else []
        if not gids:
            return []
        pipe = self.r.pipeline(transaction=False)
        for g in gids:
            pipe.hget(keys.query(g), "tokens")
        return [(g, _f(t)) for g, t in zip(gids, pipe.execute(), strict=True)]

    def queued_ids(self, cluster: str) -> list[str]:
        return self.r.lrange(keys.queue(cluster), 0, -1)

    def inflight_ids(self, cluster: str) -> list[str]:
        return self.r.zrange(keys.inflight(cluster), 0, -1)
