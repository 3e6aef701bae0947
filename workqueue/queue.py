"""Typed API over the Redis schema: batches, per-cluster queues, leases, results, heartbeats.

Delivery is at-least-once with write-once results: a worker *claims* queries (they move
from the cluster's queue into its in-flight set with a lease deadline), renews the lease
while it works, and *completes* each query once. A worker that dies stops renewing; its
leases expire and :meth:`WorkQueue.requeue_expired` puts those queries back at the head
of the queue. A second completion of the same query id is ignored, so a query that ran
twice still has exactly one result. The claim side lives in :mod:`workqueue.leases`:

* lease deadlines and their expiry are measured on the Redis server's clock, not the
  clients' (a skewed client clock neither expires live leases nor keeps dead ones);
* a late completion, by a worker whose lease lapsed after its query was requeued, counts
  and takes the query back out of its queue and its tokens out of ``pending``;
* a query whose ``max_attempts``-th claim lapses (default 3) fails with its error
  recorded instead of running forever, and the rest of its batch goes on.

:meth:`WorkQueue.create_batch` is atomic and idempotent by batch id: concurrent calls with
one new id create the batch once (one returns True, the others False, none raises), and a
batch hash without ``status`` (a creation cut short under older code) counts as absent.

``clock`` (default :func:`time.time`) stamps what only ends up in records: creation,
enqueue, claim and completion times, heartbeats.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict

import redis

from workqueue import keys, scripts
from workqueue.leases import DEFAULT_MAX_ATTEMPTS, LeaseOps
from workqueue.mover import MoverLease
from workqueue.records import (
    FINAL_STATES,
    BatchInfo,
    ClaimedQuery,
    ClusterInfo,
    QueuedQuery,
    as_float,
    as_int,
)

__all__ = ["FINAL_STATES", "BatchInfo", "ClaimedQuery", "ClusterInfo", "QueuedQuery", "WorkQueue"]

DEFAULT_RETENTION_S = 7 * 24 * 3600  # finished batches (status, results) are kept a week
PRUNE_CHUNK = 1000  # batch ids one prune call looks at
SWEEP_CHUNK = 1000  # queued ids one cancel-sweep call looks at (keeps each script call short)
CREATE_RETRIES = 20  # optimistic-transaction retries of create_batch (each lost race re-reads)


class WorkQueue(LeaseOps):
    """All queue operations on one Redis connection (thread-safe: redis-py pools connections).

    ``clock`` stamps records (lease deadlines use Redis time whatever it says);
    ``max_attempts`` is how many lapsed claims a query gets before it fails (None or 0: no
    limit); see :mod:`workqueue.leases`.
    """

    def __init__(
        self,
        client: redis.Redis,
        *,
        clock: Callable[[], float] = time.time,
        max_attempts: int | None = DEFAULT_MAX_ATTEMPTS,
        retention_s: float = DEFAULT_RETENTION_S,
    ):
        if not retention_s >= 0:
            raise ValueError(f"retention_s must be >= 0 (0: keep forever), not {retention_s}")
        self.r = client
        self.retention_s = int(retention_s)
        self._init_leases(client, clock, max_attempts)
        self._move_tail = client.register_script(scripts.MOVE_TAIL)
        self._cancel = client.register_script(scripts.CANCEL)
        self._sweep = client.register_script(scripts.SWEEP_CANCELLED)

    @classmethod
    def from_url(cls, url: str, **kw) -> WorkQueue:
        return cls(redis.Redis.from_url(url, decode_responses=True), **kw)

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
        now = self.clock()
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
                    capacity_hint_tps=as_float(info.get("capacity_hint_tps") or hb.get("capacity_hint_tps")),
                    plan_tps=as_float(info.get("plan_tps") or hb.get("plan_tps")),
                    max_query_tokens=as_int(info.get("max_query_tokens") or hb.get("max_query_tokens")),
                    kv_budget_tokens=as_int(info.get("kv_budget_tokens") or hb.get("kv_total_tokens")),
                    alive=bool(hb),
                    last_heartbeat=as_float(hb.get("ts") or info.get("last_seen")),
                    measured_tps=as_float(hb.get("tokens_per_s")),
                    running=as_int(hb.get("running")),
                    waiting=as_int(hb.get("waiting")),
                    kv_used_tokens=as_int(hb.get("kv_used_tokens")),
                    kv_total_tokens=as_int(hb.get("kv_total_tokens")),
                    kv_step_tokens=as_int(hb.get("kv_step_tokens")),
                    kv_token_seconds=as_float(hb.get("kv_token_seconds")),
                    running_remaining_tokens=as_float(hb.get("running_remaining_tokens")),
                    queue_length=int(qlen),
                    inflight=int(infl),
                    pending_tokens=max(0.0, as_float(pend)),
                    assigned_predicted_tokens=as_float(stats.get("assigned_predicted_tokens")),
                    finished_predicted_tokens=as_float(stats.get("finished_predicted_tokens")),
                    finished_actual_tokens=as_int(stats.get("finished_actual_tokens")),
                    finished_queries=as_int(stats.get("finished_queries")),
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

        Atomic and idempotent by ``batch_id``: returns True when this call created the batch,
        False (changing nothing) when a batch with this id exists, also when a concurrent call
        created it first; the existing batch is readable as soon as False comes back. The
        check and the writes are one optimistic transaction (WATCH on the batch hash, then
        MULTI/EXEC), retried when another writer touched the hash in between. A batch hash
        without ``status`` (all the older code had written when it died mid-creation) counts
        as absent and is overwritten.
        """
        if ":" in batch_id or not batch_id:
            raise ValueError(f"bad batch id {batch_id!r}")
        now = self.clock()
        per_cluster: dict[str, int] = {}
        per_cluster_tokens: dict[str, float] = {}
        for q, c in assignments:
            per_cluster[c] = per_cluster.get(c, 0) + 1
            per_cluster_tokens[c] = per_cluster_tokens.get(c, 0.0) + q.total_tokens
        rows = [(q.gid, json.dumps(asdict(q)), q.total_tokens, c) for q, c in assignments]
        bkey = keys.batch(batch_id)
        with self.r.pipeline(transaction=True) as pipe:
            for _ in range(CREATE_RETRIES):
                try:
                    pipe.watch(bkey)
                    if pipe.hexists(bkey, "status"):
                        return False
                    pipe.multi()
                    self._write_batch(
                        pipe, batch_id, rows, per_cluster, per_cluster_tokens, policy, metadata, now
                    )
                    if not rows and self.retention_s:  # final at birth
                        for key in (bkey, keys.results(batch_id), keys.done(batch_id)):
                            pipe.expire(key, self.retention_s)
                    pipe.execute()
                    return True
                except redis.WatchError:
                    continue
        raise RuntimeError(f"batch {batch_id}: creation kept racing with other writers")

    def _write_batch(
        self, pipe, batch_id, rows, per_cluster, per_cluster_tokens, policy, metadata, now
    ) -> None:
        bkey = keys.batch(batch_id)
        pipe.delete(bkey)  # a hash without status is a creation cut short: start afresh
        pipe.hset(
            bkey,
            mapping={
                "created_at": now,
                "status": "in_progress" if rows else "completed",
                "total": len(rows),
                "completed": 0,
                "failed": 0,
                "cancelled": 0,
                "completed_at": 0 if rows else now,
                "policy": policy,
                "metadata": json.dumps(dict(metadata or {})),
                "queries_per_cluster": json.dumps(per_cluster),
                "predicted_tokens_per_cluster": json.dumps(per_cluster_tokens),
                "retention_s": self.retention_s,
            },
        )
        pipe.zadd(keys.BATCHES, {batch_id: now})
        for gid, payload, tokens, c in rows:
            pipe.hset(
                keys.query(gid),
                mapping={
                    "payload": payload,
                    "tokens": tokens,
                    "cluster": c,
                    "state": "queued",
                    "attempts": 0,
                    "enqueued_at": now,
                },
            )
            pipe.rpush(keys.queue(c), gid)
        for c, t in per_cluster_tokens.items():
            pipe.sadd(keys.CLUSTERS, c)
            pipe.hsetnx(keys.cluster_info(c), "state", "active")
            pipe.incrbyfloat(keys.pending(c), t)
            pipe.hincrbyfloat(keys.cluster_stats(c), "assigned_predicted_tokens", t)
            pipe.hincrby(keys.cluster_stats(c), "assigned_queries", per_cluster[c])

    def batch(self, batch_id: str) -> BatchInfo | None:
        h = self.r.hgetall(keys.batch(batch_id))
        if not h or "status" not in h:
            return None
        return BatchInfo(
            batch_id=batch_id,
            status=h["status"],
            total=as_int(h.get("total")),
            completed=as_int(h.get("completed")),
            failed=as_int(h.get("failed")),
            cancelled=as_int(h.get("cancelled")),
            created_at=as_float(h.get("created_at")),
            completed_at=as_float(h.get("completed_at")),
            policy=h.get("policy", ""),
            metadata=json.loads(h.get("metadata") or "{}"),
            queries_per_cluster=json.loads(h.get("queries_per_cluster") or "{}"),
            predicted_tokens_per_cluster=json.loads(h.get("predicted_tokens_per_cluster") or "{}"),
        )

    def batch_ids(self, limit: int = 100, newest_first: bool = True) -> list[str]:
        """Ids of batches not yet expired, by creation time."""
        self.prune_batches()
        return self.r.zrange(keys.BATCHES, 0, limit - 1, desc=newest_first)

    def prune_batches(self, chunk: int = PRUNE_CHUNK) -> int:
        """Forget up to ``chunk`` of the oldest batch ids whose batch expired; returns how many."""
        ids = self.r.zrange(keys.BATCHES, 0, chunk - 1)
        if not ids:
            return 0
        pipe = self.r.pipeline(transaction=False)
        for b in ids:
            pipe.exists(keys.batch(b))
        gone = [b for b, alive in zip(ids, pipe.execute(), strict=True) if not alive]
        if gone:
            self.r.zrem(keys.BATCHES, *gone)
        return len(gone)

    def batch_status(self, batch_id: str) -> str | None:
        return self.r.hget(keys.batch(batch_id), "status")

    def batch_statuses(self, batch_ids: Iterable[str]) -> dict[str, str | None]:
        ids = list(batch_ids)
        pipe = self.r.pipeline(transaction=False)
        for b in ids:
            pipe.hget(keys.batch(b), "status")
        return dict(zip(ids, pipe.execute(), strict=True))

    def cancel_batch(self, batch_id: str, chunk: int = SWEEP_CHUNK) -> int:
        """Cancel a batch; returns how many of its queued queries this call cancelled (-1: unknown batch).

        Lazy, with a bounded sweep: one O(1) script marks the batch ``cancelling`` (claims from
        then on drop its queries and workers abort its running ones), then each queue is swept
        in calls that look at most ``chunk`` ids, so Redis is never blocked for long whatever
        the queues hold. Ids that claims or moves shift past the sweep are dropped by the claim
        that reaches them.
        """
        marked = int(self._cancel(keys=[keys.batch(batch_id)], args=[batch_id, self.clock()]))
        if marked <= 0:
            return marked
        return sum(self.sweep_cancelled(c, chunk) for c in self.cluster_names())

    def sweep_cancelled(self, cluster: str, chunk: int = SWEEP_CHUNK) -> int:
        """Take the queued queries of cancelling batches out of one queue, ``chunk`` ids per call."""
        if chunk <= 0:
            raise ValueError(f"chunk must be > 0, not {chunk}")
        start, total = 0, 0
        while True:
            n, looked, start = self._sweep(
                keys=[keys.queue(cluster), keys.pending(cluster)], args=[cluster, start, chunk, self.clock()]
            )
            total += int(n)
            if int(looked) < chunk:
                return total

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

    # ------------------------------------------------------------------ workers (claims: LeaseOps)

    def record_observed(self, rows: Sequence[Mapping], cap: int = 1_000_000) -> None:
        """Append observed (prompt, length) records for predictor retraining; keeps the newest ``cap``."""
        if rows:
            pipe = self.r.pipeline(transaction=False)
            pipe.rpush(keys.OBSERVED, *[json.dumps(dict(r)) for r in rows])
            pipe.ltrim(keys.OBSERVED, -cap, -1)
            pipe.execute()

    # ------------------------------------------------------------------ moving work

    def mover_lease(self, owner: str, ttl_s: float = 30.0, wait_s: float = 0.0) -> MoverLease:
        """The lease every mover (offloader, rebalance, any gateway replica) holds while it plans and
        moves: ``with queue.mover_lease("offloader") as held: ...`` (see :mod:`workqueue.mover`)."""
        return MoverLease(self.r, owner, ttl_s, wait_s)

    def move_tail(self, src: str, dst: str, n: int) -> tuple[int, float]:
        """Atomically move up to ``n`` not-yet-started queries from the back of ``src``'s queue to ``dst``'s."""
        if src == dst or n <= 0:
            return 0, 0.0
        moved, tokens = self._move_tail(
            keys=[keys.queue(src), keys.queue(dst), keys.pending(src), keys.pending(dst)], args=[src, dst, n]
        )
        return int(moved), float(tokens)

    def tail(self, cluster: str, n: int) -> list[tuple[str, float]]:
        """The last ``n`` queued query ids of a cluster (back of the queue last) with their predicted tokens."""
        gids = self.r.lrange(keys.queue(cluster), -n, -1) if n > 0 else []
        if not gids:
            return []
        pipe = self.r.pipeline(transaction=False)
        for g in gids:
            pipe.hget(keys.query(g), "tokens")
        return [(g, as_float(t)) for g, t in zip(gids, pipe.execute(), strict=True)]

    def queued_ids(self, cluster: str) -> list[str]:
        return self.r.lrange(keys.queue(cluster), 0, -1)

    def inflight_ids(self, cluster: str) -> list[str]:
        return self.r.zrange(keys.inflight(cluster), 0, -1)
