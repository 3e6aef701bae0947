"""A tick's queue work in a constant number of round trips, however many clusters or batches it covers.

The gateway's offloader, its status reads and its intake each used to call Redis once per
cluster or per batch (requeue each cluster's lapsed leases, read each donor's tail, move and
announce one move at a time, read each listed batch). On a WAN every call is a round trip.
:class:`TickOps` does each of those for many clusters or batches at once:

* :meth:`TickOps.requeue_all_expired`: one script call requeues the lapsed leases of every
  cluster (REQUEUE_ALL: REQUEUE_EXPIRED's body per cluster) and returns the clusters' names;
* :meth:`TickOps.tails`: the tails of many queues, two pipelines (their ids, then their tokens);
* :meth:`TickOps.move_many`: many ``MOVE_IDS`` calls in one pipeline, then one announcement;
* :meth:`TickOps.batches`: many batch hashes in one pipeline;
* :meth:`TickOps.enqueue_parts`: the parts of an intake chunk (``ENQUEUE_CHUNK`` calls of a
  bounded size each, so no one call holds Redis long) in one pipeline, then one announcement.

:func:`eval_many` runs one script many times in one pipeline with ``EVALSHA``, loading the script
only when Redis lacks it (:mod:`workqueue.script_call`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import redis
from redis.commands.core import Script

from workqueue import keys, move_scripts
from workqueue.batches import INTAKE, SWEEP_CHUNK, batch_info, intake_key, intake_lease_key
from workqueue.lease import ttl_ms
from workqueue.lua_queue import LIBRARY
from workqueue.records import BatchInfo, as_float
from workqueue.script_call import ScriptCall, execute
from workqueue.wake import announce

# ARGV: none. Requeues the lapsed leases of every cluster in the cluster set (as REQUEUE_EXPIRED does
# for one) and returns {name, requeued, name, requeued, ...}.
REQUEUE_ALL = LIBRARY.script(
    r"""
local out = {}
local now = server_now()
for _, c in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  out[#out + 1] = c
  out[#out + 1] = requeue_lapsed(c, k_inflight(c), k_queue(c), k_pending(c), now)
end
return out
"""
)


UNFINISHED_READ = 1000  # unfinished batches an offloader tick reads (for their ETAs), earliest deadline first

# KEYS: the deadlines set. ARGV: n. The first n unfinished batches with a deadline: {id, HGETALL of its hash, ...}.
READ_UNFINISHED = LIBRARY.script(
    r"""
local out = {}
for _, bid in ipairs(redis.call('ZRANGE', KEYS[1], 0, tonumber(ARGV[1]) - 1)) do
  out[#out + 1] = bid
  out[#out + 1] = redis.call('HGETALL', k_batch(bid))
end
return out
"""
)


@dataclass(frozen=True)
class TickStart:
    """What an offloader tick starts from: lapsed leases requeued by cluster, batches that expired, and the
    unfinished batches with a deadline (for their ETAs)."""

    requeued: dict[str, int]
    expired: list[str]
    unfinished: list[BatchInfo]


def eval_many(client: redis.Redis, script: Script, calls: Sequence[tuple[Sequence, Sequence]]) -> list:
    """Run ``script`` once per ``(keys, args)`` of ``calls``, in order, in one pipeline; their replies
    (:func:`workqueue.script_call.execute`: two more round trips when Redis lacks the script)."""
    return execute(client, [ScriptCall(script, list(k), list(a)) for k, a in calls])


class TickOps:
    """Many clusters or batches per round trip; mixed into :class:`workqueue.queue.WorkQueue`."""

    r: redis.Redis
    _enqueue_chunk: Script
    _expire_due: Script
    clock: Callable[[], float]
    sweep_cancelled: Callable[[str], int]

    def _init_ticks(self, client: redis.Redis) -> None:
        self._requeue_all = client.register_script(REQUEUE_ALL)
        self._read_unfinished = client.register_script(READ_UNFINISHED)
        self._move_ids_many = client.register_script(move_scripts.MOVE_IDS)

    def requeue_all_expired(self) -> dict[str, int]:
        """Requeue the lapsed leases of every registered cluster (as :meth:`requeue_expired` does for
        one), in one script call; returns every cluster's name with how many it requeued."""
        flat = eval_many(self.r, self._requeue_all, [([keys.CLUSTERS], [])])[0]
        return {flat[i]: int(flat[i + 1]) for i in range(0, len(flat), 2)}

    def requeue_and_expire(self, unfinished: int = UNFINISHED_READ) -> TickStart:
        """:meth:`requeue_all_expired`, the first step of :meth:`expire_due` (the batches whose deadline
        passed become ``expiring``; the queues are swept only then) and a read of the first
        ``unfinished`` unfinished batches with a deadline, by deadline: one round trip."""
        calls = [
            ScriptCall(self._requeue_all, [keys.CLUSTERS], []),
            ScriptCall(self._expire_due, [keys.DEADLINES], [self.clock(), SWEEP_CHUNK]),
            ScriptCall(self._read_unfinished, [keys.DEADLINES], [unfinished]),
        ]
        flat, expired, raw = execute(self.r, calls)
        if expired:
            for c in flat[::2]:
                self.sweep_cancelled(c)
        batches = []
        for bid, fields in zip(raw[::2], raw[1::2], strict=True):
            info = batch_info(bid, dict(zip(fields[::2], fields[1::2], strict=True)))
            if info is not None:
                batches.append(info)
        requeued = {flat[i]: int(flat[i + 1]) for i in range(0, len(flat), 2)}
        return TickStart(requeued, list(expired), batches)

    def tails(self, reads: Mapping[str, tuple[int, int]]) -> dict[str, list[tuple[str, float]]]:
        """:meth:`tail` of many clusters (``cluster -> (n, skip)``) in two round trips: each cluster's
        last ``n`` queued ids before its last ``skip``, with their predicted tokens."""
        names = [c for c, (n, _) in reads.items() if n > 0]
        out: dict[str, list[tuple[str, float]]] = {c: [] for c in reads}
        if not names:
            return out
        pipe = self.r.pipeline(transaction=False)
        for c in names:
            n, skip = reads[c]
            pipe.zrange(keys.queue(c), -(skip + n), -(skip + 1))
        ids = dict(zip(names, pipe.execute(), strict=True))
        pipe = self.r.pipeline(transaction=False)
        for c in names:
            for g in ids[c]:
                pipe.hget(keys.query(g), "tokens")
        tokens = iter(pipe.execute())
        for c in names:
            out[c] = [(g, as_float(next(tokens))) for g in ids[c]]
        return out

    def move_many(self, moves: Sequence[tuple[str, str, Sequence[str], int]]) -> list[tuple[int, float]]:
        """:meth:`move_ids` of many moves ``(src, dst, gids, window)``, in order, in one pipeline (each
        move stays one atomic script call), then one announcement of the clusters that got work;
        returns each move's ``(moved, predicted tokens moved)``."""
        calls = [
            ([keys.queue(s), keys.queue(d), keys.pending(s), keys.pending(d)], [s, d, max(1, int(w)), *g])
            for s, d, g, w in moves
        ]
        replies = eval_many(self.r, self._move_ids_many, calls)
        out = [(int(m), float(t)) for m, t in replies]
        announce(self.r, [d for (_, d, _, _), (m, _) in zip(moves, out, strict=True) if m])
        return out

    def batches(self, batch_ids: Iterable[str]) -> dict[str, tuple[BatchInfo | None, dict[str, str]]]:
        """Many batches in one round trip: per id its :class:`BatchInfo` (None: none) and raw hash."""
        ids = list(batch_ids)
        pipe = self.r.pipeline(transaction=False)
        for b in ids:
            pipe.hgetall(keys.batch(b))
        return {b: (batch_info(b, h), h) for b, h in zip(ids, pipe.execute(), strict=True)}

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
        calls, at, now = [], cursor, self.clock()
        for rows in parts:
            args: list = [batch_id, token, at, now, ttl_ms(ttl_s)]
            for g, payload, tokens, c in rows:
                args += [g, payload, tokens, c]
            calls.append((k, args))
            at += len(rows)
        handled = [int(n) for n in eval_many(self.r, self._enqueue_chunk, calls)]
        landed = [c for rows, n in zip(parts, handled, strict=True) if n > 0 for _, _, _, c in rows]
        announce(self.r, landed)
        return handled
