"""Background intake (:class:`Intake`): accepting a batch (its rows stored durably, the batch created
``validating``), landing its rows chunk by chunk under its intake lease
(:meth:`Intake.enqueue_parts`: the parts of a chunk in one round trip), which batches are in
intake (a page at a time), where a batch's next chunk starts, how long a batch has waited for
a cluster, and what becomes of a batch whose intake list was lost. The gateway's intake loop
(:mod:`gateway.intake`) drives it.

**Waiting.** A chunk whose rows only a cluster that is not alive now could take waits for it
(see :mod:`gateway.assign.placement`); the batch hash remembers since when (``intake_waiting_since``,
the caller's clock), so the bound on the wait holds across gateway replicas and restarts.

**A lost intake list** (evicted, deleted by hand, lost in a failover) leaves rows that can
never be enqueued: their ids were in it. :meth:`Intake.fail_lost_intake` counts them as
failed (``cancelled`` when the batch is being cancelled or expiring) in one script call, records how many
(``intake_lost``) and why (``error``), takes the batch out of the intake set and, when nothing
else of it is queued or running, gives it its final status (``failed`` when nothing completed).
The rows have no result line: only their count survives. The queue invariants
(:mod:`workqueue.invariants`) count ``intake_lost`` among the finished.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import redis

from workqueue import batch_scripts, keys
from workqueue.batches import (
    INTAKE,
    STAGE_CHUNK,
    STAGE_TTL_S,
    Schedule,
    intake_key,
    intake_lease_key,
    staging_key,
)
from workqueue.core import QueueCore
from workqueue.lease import Lease, ttl_ms
from workqueue.lua_queue import LIBRARY
from workqueue.records import BatchState, as_int
from workqueue.script_call import ScriptCall, execute
from workqueue.wake import announce

WAITING = "intake_waiting_since"  # batch hash field: when intake began to wait for a cluster
LOST = "intake_lost"  # batch hash field: rows counted finished because the intake list was lost

# KEYS: a staging list. ARGV: the rows it holds before this append, seconds to live, the rows. Appends once: a
# resent call (its first run's reply lost) finds the rows there and only renews the list's time; a list that
# does not hold the rows before (it expired between two parts) is an error. Returns the list's new length.
STAGE_APPEND = """
local before, n = tonumber(ARGV[1]), #ARGV - 2
local have = redis.call('LLEN', KEYS[1])
if have ~= before + n then
  if have ~= before then return redis.error_reply('STAGED ' .. have .. ' rows where ' .. before .. ' were') end
  redis.call('RPUSH', KEYS[1], unpack(ARGV, 3))
end
redis.call('EXPIRE', KEYS[1], ARGV[2])
return before + n
"""

# KEYS: batch hash. ARGV: now, the field. Since when the batch waits (now if it did not); nil: no batch.
WAIT = """
if redis.call('HEXISTS', KEYS[1], 'status') == 0 then return false end
redis.call('HSETNX', KEYS[1], ARGV[2], ARGV[1])
return redis.call('HGET', KEYS[1], ARGV[2])
"""

# KEYS: batch hash, intake list, intake set. ARGV: batch id, why, now.
# Returns the rows counted lost; 0: nothing was left to enqueue; -1: the list is there; -2: no batch.
LOST_INTAKE = LIBRARY.script(
    r"""
local b, bid = KEYS[1], ARGV[1]
local h = redis.call('HMGET', b, 'status', 'intake_done', 'intake_total')
if not h[1] then return -2 end
if redis.call('EXISTS', KEYS[2]) == 1 then return -1 end
local total = tonumber(h[3] or '0')
local lost = total - tonumber(h[2] or '0')
redis.call('ZREM', KEYS[3], bid)
if lost <= 0 then return 0 end
local kind = 'failed'
if stop_reason(h[1]) then kind = 'cancelled' end
redis.call('HINCRBY', b, kind, lost)
redis.call('HSET', b, 'intake_done', total, '"""
    + LOST
    + """', lost, 'error', ARGV[2])
settle(bid, ARGV[3])
return lost
"""
)


class BatchWriter(Protocol):
    """What :class:`Intake` needs of the batches' part (:class:`workqueue.batches.Batches`): a batch is
    accepted in the same optimistic transaction, with the same writes, as one created at once."""

    def create_once(self, batch_id: str, write: Callable[[Any], None], what: str) -> bool: ...

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
    ) -> None: ...


class StagedRowsMissing(RuntimeError):
    """The staging list does not hold the rows its parts sent (it expired between two parts, or a resent
    write doubled one): nothing is created."""


class Intake:
    """Accepting a batch for background intake, landing its chunks, its waits and lost intake lists, on
    ``core``'s Redis (``core.clock``: acceptance times and waits; ``core.order``: the batch's place in
    the queues); batches are created through ``batches``."""

    def __init__(self, core: QueueCore, batches: BatchWriter) -> None:
        self.core, self.batches = core, batches
        self.r = core.r
        self._wait = core.script(WAIT)
        self._stage_append = core.script(STAGE_APPEND)
        self._lost_intake = core.script(LOST_INTAKE)
        self._enqueue_chunk = core.script(batch_scripts.ENQUEUE_CHUNK)

    def accept_batch(
        self,
        batch_id: str,
        rows: Sequence[str],
        *,
        policy: str = "",
        metadata: Mapping[str, str] | None = None,
        fingerprint: str = "",
        chunk: int = STAGE_CHUNK,
        extra: Callable[[Any], None] | None = None,
        deadline: float = 0.0,
        priority: int = 0,
        window_s: float = 0.0,
    ) -> bool:
        """Accept a batch for background intake: store its ``rows`` durably, then create it ``validating``.

        Same contract as :meth:`create_batch` (atomic, idempotent by ``batch_id``; True when this
        call created it; ``extra``, ``deadline``, ``window_s`` and ``priority`` as there). The rows go to a
        staging list of this call (:meth:`new_stage`, :meth:`stage_rows`; a gateway that dies here leaves
        only that list, which expires); then :meth:`accept_staged` creates the batch from it.
        """
        if not rows:
            raise ValueError("a batch accepted for intake needs rows")
        stage = self.new_stage(batch_id)
        try:
            self.stage_rows(stage, rows, chunk)
        except BaseException:
            self.r.delete(stage)
            raise
        return self.accept_staged(
            batch_id,
            stage,
            len(rows),
            policy=policy,
            metadata=metadata,
            fingerprint=fingerprint,
            extra=extra,
            deadline=deadline,
            priority=priority,
            window_s=window_s,
        )

    def new_stage(self, batch_id: str) -> str:
        """A new staging list's key for rows of ``batch_id`` (nothing is written)."""
        if ":" in batch_id or not batch_id:
            raise ValueError(f"bad batch id {batch_id!r}")
        return staging_key(batch_id, uuid.uuid4().hex)

    def stage_rows(self, stage: str, rows: Sequence[str], chunk: int = STAGE_CHUNK, start: int = 0) -> int:
        """Append ``rows`` to the staging list ``stage``, which holds ``start`` rows before, in calls of
        ``chunk`` rows; returns the rows it holds after. Each call appends once: one resent after its reply
        was lost finds its rows there. The list expires ``STAGE_TTL_S`` after its last write unless
        :meth:`accept_staged` takes it; :class:`StagedRowsMissing` when it no longer holds ``start`` rows."""
        held = start
        for i in range(0, len(rows), chunk):
            part = rows[i : i + chunk]
            try:
                held = int(self._stage_append(keys=[stage], args=[held, STAGE_TTL_S, *part]))
            except redis.ResponseError as e:
                if not str(e).startswith("STAGED"):
                    raise
                raise StagedRowsMissing(f"staging list {stage}: {e}; send the batch again") from None
        return held

    def drop_stage(self, stage: str) -> None:
        """Delete a staging list that will not become a batch."""
        self.r.delete(stage)

    def accept_staged(
        self,
        batch_id: str,
        stage: str,
        total: int,
        *,
        policy: str = "",
        metadata: Mapping[str, str] | None = None,
        fingerprint: str = "",
        extra: Callable[[Any], None] | None = None,
        deadline: float = 0.0,
        priority: int = 0,
        window_s: float = 0.0,
    ) -> bool:
        """Create the batch from the ``total`` rows staged in ``stage``: one optimistic transaction checks
        that no batch has the id, creates the batch hash (``total`` = ``intake_total`` = the rows,
        ``intake_done`` 0), renames the staging list to the batch's intake list and puts the id in the
        intake set. Nothing is queued yet. The staging list is deleted when this call did not create it;
        :class:`StagedRowsMissing` when it does not hold ``total`` rows.
        """
        if total < 1:
            raise ValueError("a batch accepted for intake needs rows")
        bkey = keys.batch(batch_id)
        pipe = self.r.pipeline(transaction=True)
        pipe.llen(stage)
        pipe.persist(stage)  # it can no longer expire before it is renamed (or deleted below)
        staged, _ = pipe.execute()
        if staged != total:  # expired between two parts, or a part written twice
            self.r.delete(stage)
            raise StagedRowsMissing(
                f"batch {batch_id}: {staged} rows staged, {total} sent; send the batch again"
            )

        def write(pipe) -> None:
            now = self.core.clock()
            end = now + window_s if window_s else deadline
            when = Schedule(now, end, priority, self.core.order.key(now, end, priority))
            self.batches.write_batch(pipe, batch_id, [], {}, {}, policy, metadata, when, 0)
            if end:
                pipe.zadd(keys.DEADLINES, {batch_id: end})
            pipe.hset(
                bkey,
                mapping={
                    "status": BatchState.VALIDATING,
                    "total": total,
                    "completed_at": 0,
                    "intake_total": total,
                    "intake_done": 0,
                    "fingerprint": fingerprint,
                },
            )
            pipe.rename(stage, intake_key(batch_id))
            pipe.persist(intake_key(batch_id))
            pipe.zadd(INTAKE, {batch_id: now})
            if extra:
                extra(pipe)

        created = False
        try:
            created = self.batches.create_once(batch_id, write, "acceptance")
            return created
        finally:
            if not created:  # renamed away when this call created the batch
                self.r.delete(stage)

    def intake_batches(self, limit: int = 100) -> list[str]:
        """Ids of accepted batches whose intake is unfinished, oldest first."""
        return self.r.zrange(INTAKE, 0, limit - 1)

    def take_intake(self, batch_id: str, token: str, ttl_s: float) -> bool:
        """Take the batch's intake lease (True: this token may enqueue its rows for ``ttl_s``)."""
        return Lease(self.r, intake_lease_key(batch_id), token, ttl_s).acquire()

    def drop_intake(self, batch_id: str, token: str) -> None:
        """Give the intake lease back, if ``token`` still holds it."""
        Lease(
            self.r, intake_lease_key(batch_id), token, ttl_s=1.0
        ).release()  # (a release has no use for the ttl)

    def intake_state(self, batch_id: str, n: int, start: int = 0) -> tuple[str | None, int, int, list[str]]:
        """``(status, intake_done, intake_total, n rows from index start)`` of a batch in intake (the
        list's head is the row at ``intake_done``)."""
        pipe = self.r.pipeline(transaction=True)
        pipe.hmget(keys.batch(batch_id), "status", "intake_done", "intake_total")
        pipe.lrange(intake_key(batch_id), start, start + n - 1)
        (status, done, total), rows = pipe.execute()
        return status, as_int(done), as_int(total), rows

    def enqueue_chunk(
        self,
        batch_id: str,
        token: str,
        cursor: int,
        rows: Sequence[tuple[str, str, float, str]],
        ttl_s: float,
    ) -> int:
        """Land one chunk of rows ``(gid, payload, predicted tokens, cluster)``: :meth:`enqueue_parts`
        with one part (``-1``: not ``token``'s lease, ``-2``: no such batch, ``-3``: stale cursor)."""
        return self.enqueue_parts(batch_id, token, cursor, [rows], ttl_s)[0]

    def enqueue_parts(
        self,
        batch_id: str,
        token: str,
        cursor: int,
        parts: Sequence[Sequence[tuple[str, str, float, str]]],
        ttl_s: float,
    ) -> list[int]:
        """Land a chunk's ``parts`` (rows ``(gid, payload, predicted tokens, cluster)``, part k at
        ``cursor`` plus the rows of the parts before it) with one ``ENQUEUE_CHUNK`` call each, all in
        one pipeline (see ``batch_scripts.ENQUEUE_CHUNK``); then the clusters that got rows are announced.

        Cluster ``''`` fails the row at once (its payload is its result JSON). Per part: the rows
        handled, or -1 (the lease is not ``token``'s), -2 (no such batch), -3 (the cursor is
        stale). Each call checks the lease and its own cursor, so a part lands only where the
        batch's intake stands, exactly the rows at the head of its list: none lands twice or out
        of order, and the parts after a refused one are refused too (its rows did not move the
        cursor)."""
        k = [keys.batch(batch_id), intake_lease_key(batch_id), intake_key(batch_id), INTAKE, keys.CLUSTERS]
        calls: list[ScriptCall] = []
        at, now = cursor, self.core.clock()
        for rows in parts:
            args: list = [batch_id, token, at, now, ttl_ms(ttl_s)]
            for g, payload, tokens, c in rows:
                args += [g, payload, tokens, c]
            calls.append(ScriptCall(self._enqueue_chunk, k, args))
            at += len(rows)
        handled = [int(n) for n in execute(self.r, calls)]
        landed = [c for rows, n in zip(parts, handled, strict=True) if n > 0 for _, _, _, c in rows]
        announce(self.r, landed)
        return handled

    def forget_intake(self, batch_id: str) -> None:
        """Drop the intake of a batch that no longer exists (expired or never created)."""
        pipe = self.r.pipeline(transaction=True)
        pipe.zrem(INTAKE, batch_id)
        pipe.delete(intake_key(batch_id))
        pipe.execute()

    def intake_page(self, start: int, n: int) -> list[str]:
        """Up to ``n`` ids of batches in intake, from index ``start`` of the intake set (oldest first)."""
        return self.r.zrange(INTAKE, start, start + n - 1)

    def intake_head(self, batch_id: str) -> tuple[str | None, int, int, str]:
        """``(status, intake_done, intake_total, created_at)`` of a batch in intake: where its next
        chunk starts, and which batch it is (a batch created again under the id has another
        ``created_at``); no rows are read."""
        h = self.r.hmget(keys.batch(batch_id), "status", "intake_done", "intake_total", "created_at")
        return h[0], as_int(h[1]), as_int(h[2]), h[3] or ""

    def intake_wait(self, batch_id: str) -> float | None:
        """Since when the batch's intake waits for a cluster (starting now if it was not waiting);
        None when the batch does not exist."""
        since = self._wait(keys=[keys.batch(batch_id)], args=[self.core.clock(), WAITING])
        return None if since is None else float(since)

    def intake_waited(self, batch_id: str) -> None:
        """The batch's intake no longer waits (a chunk found a cluster for every row)."""
        self.r.hdel(keys.batch(batch_id), WAITING)

    def fail_lost_intake(self, batch_id: str, why: str) -> int:
        """Count the rows of a batch whose intake list is gone as failed (see the module docstring);
        returns how many, 0 when none were left, -1 when the list exists after all, -2 without a batch."""
        k = [keys.batch(batch_id), intake_key(batch_id), INTAKE]
        return int(self._lost_intake(keys=k, args=[batch_id, why, self.core.clock()]))
