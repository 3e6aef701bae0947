"""A tick's queue work in a constant number of round trips, however many clusters or batches it covers.

The gateway's offloader, its status reads and its intake each used to call Redis once per
cluster or per batch (requeue each cluster's lapsed leases, read each donor's tail, move and
announce one move at a time, read each listed batch). On a WAN every call is a round trip.
:class:`Ticks` does the offloader's start and the batch reads for many clusters or batches at once:

* :meth:`Ticks.requeue_all_expired`: one script call requeues the lapsed leases of every
  cluster (REQUEUE_ALL: REQUEUE_EXPIRED's body per cluster) and returns the clusters' names;
* :meth:`Ticks.requeue_and_expire`: that, the first step of expiring the batches due and a
  read of the unfinished batches with a deadline, in one round trip;
* :meth:`Ticks.batches`: many batch hashes in one pipeline.

The other many-at-once operations sit with their subject: the tails of many queues and many
moves in one pipeline in :mod:`workqueue.moves` (:meth:`~workqueue.moves.Moves.tails`,
:meth:`~workqueue.moves.Moves.move_many`), the parts of an intake chunk in one pipeline in
:mod:`workqueue.intake_ops` (:meth:`~workqueue.intake_ops.Intake.enqueue_parts`).

:func:`eval_many` runs one script many times in one pipeline with ``EVALSHA``, loading the script
only when Redis lacks it (:mod:`workqueue.script_call`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import redis
from redis.commands.core import Script

from workqueue import keys
from workqueue.batches import SWEEP_CHUNK, batch_info
from workqueue.core import QueueCore
from workqueue.lua_queue import LIBRARY
from workqueue.records import BatchInfo
from workqueue.script_call import ScriptCall, execute

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


class Expiry(Protocol):
    """What :class:`Ticks` needs of the batches' part (:class:`workqueue.batches.Batches`): the first step of
    an expiry, as a script call, and the sweep of a queue once batches expired."""

    def expire_due_call(self, now: float, chunk: int = ...) -> ScriptCall: ...

    def sweep_cancelled(self, cluster: str, chunk: int = ...) -> int: ...


class Ticks:
    """Many clusters or batches per round trip on ``core``'s Redis (``core.clock``: the clock batch
    deadlines are checked on); batches expire through ``batches``."""

    def __init__(self, core: QueueCore, batches: Expiry) -> None:
        self.core, self.expiry = core, batches
        self.r = core.r
        self._requeue_all = core.script(REQUEUE_ALL)
        self._read_unfinished = core.script(READ_UNFINISHED)

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
            self.expiry.expire_due_call(self.core.clock(), SWEEP_CHUNK),
            ScriptCall(self._read_unfinished, [keys.DEADLINES], [unfinished]),
        ]
        flat, expired, raw = execute(self.r, calls)
        if expired:
            for c in flat[::2]:
                self.expiry.sweep_cancelled(c)
        batches = []
        for bid, fields in zip(raw[::2], raw[1::2], strict=True):
            info = batch_info(bid, dict(zip(fields[::2], fields[1::2], strict=True)))
            if info is not None:
                batches.append(info)
        requeued = {flat[i]: int(flat[i + 1]) for i in range(0, len(flat), 2)}
        return TickStart(requeued, list(expired), batches)

    def batches(self, batch_ids: Iterable[str]) -> dict[str, tuple[BatchInfo | None, dict[str, str]]]:
        """Many batches in one round trip: per id its :class:`BatchInfo` (None: none) and raw hash."""
        ids = list(batch_ids)
        pipe = self.r.pipeline(transaction=False)
        for b in ids:
            pipe.hgetall(keys.batch(b))
        return {b: (batch_info(b, h), h) for b, h in zip(ids, pipe.execute(), strict=True)}
