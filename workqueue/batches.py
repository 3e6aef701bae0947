"""Batches in Redis: creation (atomic, idempotent), status, results, lazy cancel, retention.

:meth:`Batches.create_batch` is atomic and idempotent by batch id: concurrent calls with
one new id create the batch once (one returns True, the others False, none raises), and a
batch hash without ``status`` (a creation cut short under older code) counts as absent.

**Background intake** (:class:`workqueue.intake_ops.Intake`, which creates its batches with
:meth:`Batches.create_once` and :meth:`Batches.write_batch`): a large
batch is accepted durably first, its validated rows stored in Redis, and enqueued chunk by
chunk afterwards (see :mod:`gateway.intake.background`); until its last chunk lands, ``total`` counts
the rows still in its intake list too.

**Cancel** is lazy with a bounded sweep: one O(1) script marks the batch ``cancelling``,
then each queue is swept in script calls that look at most ``SWEEP_CHUNK`` ids; a claim
drops whatever a sweep missed. **Retention**: a batch that reaches a final state keeps its
hash, results and done set for ``retention_s`` (0: forever), then Redis expires them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import redis

from workqueue import batch_scripts, keys
from workqueue.core import QueueCore
from workqueue.ordering import rank
from workqueue.records import BatchInfo, BatchState, QueryResult, QueryState, QueuedQuery, as_float, as_int
from workqueue.script_call import ScriptCall
from workqueue.wake import announce

PRUNE_CHUNK = 1000  # batch ids one prune call looks at
SWEEP_CHUNK = 400  # queued ids one cancel-sweep call looks at: each call stays far under 50 ms (a 1,000-id call took 53)
CREATE_RETRIES = 20  # optimistic-transaction retries of create_batch (each lost race re-reads)
STAGE_CHUNK = 5000  # rows one staging transaction of accept_batch writes
STAGE_TTL_S = 3600  # a staging list left by a gateway that died while accepting expires after this

#: batch ids whose background intake is unfinished (ZSET, scored by acceptance time)
INTAKE = keys.INTAKE


#: batch hash fields ``left:<cluster>``: predicted tokens of the batch's unfinished queries on that cluster
LEFT = "left:"

#: the batch's intake list, its intake lease and a submission's staging list (:mod:`workqueue.keys`)
intake_key, intake_lease_key, staging_key = keys.intake, keys.intake_lease, keys.staging


@dataclass(frozen=True)
class Schedule:
    """When a batch was created, when it expires (0: never), its priority, and its place in the queues."""

    created_at: float
    deadline: float
    priority: int
    order_key: float


def batch_info(batch_id: str, h: Mapping[str, str]) -> BatchInfo | None:
    """The batch read from its hash ``h`` (None: no batch, or a creation cut short)."""
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
        fingerprint=h.get("fingerprint", ""),
        error=h.get("error", ""),
        queries_per_cluster=json.loads(h.get("queries_per_cluster") or "{}"),
        predicted_tokens_per_cluster=json.loads(h.get("predicted_tokens_per_cluster") or "{}"),
        deadline=as_float(h.get("deadline")),
        priority=as_int(h.get("priority")),
        order_key=as_float(h.get("order_key")),
        done_predicted_tokens=as_float(h.get("done_predicted_tokens")),
        done_actual_tokens=as_int(h.get("done_actual_tokens")),
        intake_left=max(0, as_int(h.get("intake_total")) - as_int(h.get("intake_done"))),
        left_tokens_per_cluster={
            k[len(LEFT) :]: max(0.0, as_float(v))
            for k, v in h.items()
            if k.startswith(LEFT) and as_float(v) > 0.005
        },
    )


class ClusterNames(Protocol):
    """What :class:`Batches` needs of the clusters' part (:class:`workqueue.clusters.Clusters`): whose queues to sweep."""

    def cluster_names(self) -> list[str]: ...


class Batches:
    """Batch lifecycle on ``core``'s Redis (``core.clock``: creation times and deadlines; ``core.order``:
    the batches' place in the queues; ``core.retention_s``: how long a finished batch is kept).
    Cancels and expiry sweep the queues of every cluster ``clusters`` names.

    For the intake (:class:`workqueue.intake_ops.Intake`), which creates batches the same way:
    :meth:`create_once` (the optimistic creating transaction) and :meth:`write_batch` (the
    batch's writes in it). For a tick (:class:`workqueue.ticks.Ticks`): :meth:`expire_due_call`."""

    def __init__(self, core: QueueCore, clusters: ClusterNames) -> None:
        self.core, self.clusters = core, clusters
        self.r = core.r
        self._expire_due = core.script(batch_scripts.EXPIRE_DUE)
        self._cancel = core.script(batch_scripts.CANCEL)
        self._sweep = core.script(batch_scripts.SWEEP_CANCELLED)

    @property
    def retention_s(self) -> int:
        """Seconds a finished batch is kept (0: forever)."""
        return self.core.retention_s

    def create_batch(
        self,
        batch_id: str,
        assignments: Sequence[tuple[QueuedQuery, str]],
        *,
        policy: str = "",
        metadata: Mapping[str, str] | None = None,
        fingerprint: str = "",
        extra: Callable[[Any], None] | None = None,
        deadline: float = 0.0,
        priority: int = 0,
        window_s: float = 0.0,
    ) -> bool:
        """Create the batch and enqueue every query on its cluster in one transaction.

        ``deadline`` (unix seconds, 0: none; or ``window_s``: that long after its creation): when the batch
        expires (:meth:`expire_due`); it and
        ``priority`` give the batch its place in every queue (:mod:`workqueue.ordering`); the
        queries keep the order of ``assignments`` within it.

        Atomic and idempotent by ``batch_id``: returns True when this call created the batch,
        False (changing nothing) when a batch with this id exists, also when a concurrent call
        created it first; the existing batch is readable as soon as False comes back. The
        check and the writes are one optimistic transaction (WATCH on the batch hash, then
        MULTI/EXEC), retried when another writer touched the hash in between. A batch hash
        without ``status`` (all the older code had written when it died mid-creation) counts
        as absent and is overwritten. ``extra(pipe)``: the caller's own writes, queued last in
        the creating transaction (the batch's owner, say), so they land with the batch or not at all.
        """
        if ":" in batch_id or not batch_id:
            raise ValueError(f"bad batch id {batch_id!r}")
        now = self.core.clock()
        deadline = now + window_s if window_s else deadline
        per_cluster: dict[str, int] = {}
        per_cluster_tokens: dict[str, float] = {}
        for q, c in assignments:
            per_cluster[c] = per_cluster.get(c, 0) + 1
            per_cluster_tokens[c] = per_cluster_tokens.get(c, 0.0) + q.charged_tokens
        rows = [(q.gid, json.dumps(asdict(q)), q.charged_tokens, c) for q, c in assignments]
        sizes = [q.total_tokens for q, _ in assignments]
        bkey = keys.batch(batch_id)
        when = Schedule(now, deadline, priority, self.core.order.key(now, deadline, priority))
        seq = int(self.r.incrby(keys.SEQ, len(rows))) - len(rows) if rows else 0

        def write(pipe) -> None:
            self.write_batch(
                pipe, batch_id, rows, per_cluster, per_cluster_tokens, policy, metadata, when, seq, sizes
            )
            if fingerprint:
                pipe.hset(bkey, "fingerprint", fingerprint)
            if deadline and rows:
                pipe.zadd(keys.DEADLINES, {batch_id: deadline})
            if not rows and self.retention_s:  # final at birth
                for key in (bkey, keys.results(batch_id), keys.done(batch_id)):
                    pipe.expire(key, self.retention_s)
            if extra:
                extra(pipe)

        created = self.create_once(batch_id, write, "creation")
        if created:
            announce(self.r, per_cluster)  # idle engines start now, not after their poll back-off
        return created

    def create_once(self, batch_id: str, write: Callable[[Any], None], what: str) -> bool:
        """Run ``write(pipe)`` in one optimistic transaction unless the batch exists; True when it ran.

        WATCH on the batch hash, a hash with ``status`` means the batch exists (False), then
        MULTI, ``write``, EXEC; retried when another writer touched the hash in between.
        """
        bkey = keys.batch(batch_id)
        with self.r.pipeline(transaction=True) as pipe:
            for _ in range(CREATE_RETRIES):
                try:
                    pipe.watch(bkey)
                    if pipe.hexists(bkey, "status"):
                        return False
                    pipe.multi()
                    write(pipe)
                    pipe.execute()
                    return True
                except redis.WatchError:
                    continue
        raise RuntimeError(f"batch {batch_id}: {what} kept racing with other writers")

    def write_batch(
        self,
        pipe: Any,
        batch_id: str,
        rows: Sequence[tuple[str, str, float, str]],
        per_cluster: Mapping[str, int],
        per_cluster_tokens: Mapping[str, float],
        policy: str,
        metadata: Mapping[str, str] | None,
        when: Schedule,
        seq: int,
        sizes: Sequence[float] = (),
    ) -> None:
        """Queue the batch's writes on ``pipe`` (in the creating transaction): its hash, its place in the
        batch list, and each row ``(gid, payload, predicted tokens, cluster)`` in its cluster's queue
        from sequence number ``seq`` on, with the clusters' counters. A row's predicted tokens are its
        charge on its cluster (less its prefix discount); ``sizes``: each row's full size (prompt +
        predicted response, :data:`workqueue.keys.FULL_TOKENS`), by position (missing: its charge)."""
        bkey, now = keys.batch(batch_id), when.created_at
        pipe.delete(bkey)  # a hash without status is a creation cut short: start afresh
        pipe.hset(
            bkey,
            mapping={
                "created_at": now,
                "deadline": when.deadline,
                "priority": when.priority,
                "order_key": when.order_key,
                "status": BatchState.IN_PROGRESS if rows else BatchState.COMPLETED,
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
        for i, (gid, payload, tokens, c) in enumerate(rows):
            r = rank(when.order_key, seq + i)
            pipe.hset(
                keys.query(gid),
                mapping={
                    "payload": payload,
                    "tokens": tokens,
                    keys.FULL_TOKENS: max(tokens, sizes[i]) if i < len(sizes) else tokens,
                    "cluster": c,
                    "state": QueryState.QUEUED,
                    "attempts": 0,
                    "enqueued_at": now,
                    "rank": r,
                },
            )
            pipe.zadd(keys.queue(c), {gid: r})
        for c, t in per_cluster_tokens.items():
            pipe.hincrbyfloat(bkey, LEFT + c, t)
        for c, t in per_cluster_tokens.items():
            pipe.sadd(keys.CLUSTERS, c)
            pipe.hsetnx(keys.cluster_info(c), "state", "active")
            pipe.incrbyfloat(keys.pending(c), t)
            pipe.hincrbyfloat(keys.cluster_stats(c), "assigned_predicted_tokens", t)
            pipe.hincrby(keys.cluster_stats(c), "assigned_queries", per_cluster[c])

    def batch(self, batch_id: str) -> BatchInfo | None:
        return batch_info(batch_id, self.r.hgetall(keys.batch(batch_id)))

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
        marked = int(self._cancel(keys=[keys.batch(batch_id)], args=[batch_id, self.core.clock()]))
        if marked <= 0:
            return marked
        return sum(self.sweep_cancelled(c, chunk) for c in self.clusters.cluster_names())

    def expire_due(self, now: float | None = None, chunk: int = SWEEP_CHUNK) -> list[str]:
        """Expire the batches whose deadline passed by ``now`` (default: the queue's clock, the one deadlines are
        set on); returns their ids. Each becomes ``expiring`` (O(1): see :mod:`workqueue.batch_scripts`), then
        the queues are swept as :meth:`cancel_batch` sweeps them: queued queries are finished ``batch_expired``,
        running ones are aborted by their workers, finished ones are kept; the batch ends ``expired``."""
        now = self.core.clock() if now is None else now
        due = self.expire_due_call(now, chunk).run()
        if due:
            for c in self.clusters.cluster_names():
                self.sweep_cancelled(c, chunk)
        return list(due)

    def expire_due_call(self, now: float, chunk: int = SWEEP_CHUNK) -> ScriptCall:
        """The EXPIRE_DUE script's call, the first step of :meth:`expire_due`: the batches whose deadline
        passed by ``now`` (``chunk`` at most) become ``expiring``; its reply is their ids."""
        return ScriptCall(self._expire_due, [keys.DEADLINES], [now, chunk])

    def sweep_cancelled(self, cluster: str, chunk: int = SWEEP_CHUNK) -> int:
        """Take the queued queries of stopping (cancelled or expiring) batches out of one queue, ``chunk`` ids per
        call."""
        if chunk <= 0:
            raise ValueError(f"chunk must be > 0, not {chunk}")
        start, total = 0, 0
        while True:
            n, looked, start = self._sweep(
                keys=[keys.queue(cluster), keys.pending(cluster)],
                args=[cluster, start, chunk, self.core.clock()],
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

    def query_results(self, batch_id: str, start: int = 0, end: int = -1) -> list[QueryResult]:
        """:meth:`results`, typed: each :class:`QueryResult` with its ``index`` set."""
        rows = self.r.lrange(keys.results(batch_id), start, end)
        out = []
        for i, row in enumerate(rows):
            r = QueryResult.from_json(row)
            r.index = start + i
            out.append(r)
        return out

    def result_count(self, batch_id: str) -> int:
        return int(self.r.llen(keys.results(batch_id)))
