"""What waits in the clusters' queues, and moving it between them: :class:`Moves`.

Movers (the offloader of every gateway replica, admin rebalance) read a queue's tail
(:meth:`Moves.tail`, :meth:`Moves.tails` for many queues in two round trips), plan, and move
later, under the mover lease (:meth:`Moves.mover_lease`, :mod:`workqueue.mover`). Each move is
one atomic script call that moves exactly the planned queries still queued
(:meth:`Moves.move_ids`; :meth:`Moves.move_many` sends many in one pipeline), with their
predicted tokens in the clusters' ``pending`` counters: a row leaves its source at its charge
there (``tokens``, less the prefix its cache holds) and is charged its full size on the
destination (:data:`workqueue.keys.FULL_TOKENS`); the clusters that got work are announced on
their wake channels. The tails movers read carry each row's full size, the size every fit check
needs (a row written before the field existed counts its ``tokens``). :meth:`Moves.fail_queued`
fails queued queries where they stand (those that fit no cluster).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from workqueue import keys, move_scripts
from workqueue.core import QueueCore
from workqueue.mover import MoverLease
from workqueue.records import QueryResult, QueryState, as_float
from workqueue.script_call import ScriptCall, execute
from workqueue.wake import announce

__all__ = ["MOVE_WINDOW_SLACK", "Moves", "full_size"]

#: entries beyond a move's own ids that :meth:`Moves.move_ids` looks at from the back of the
#: source queue: room for queries appended, and ids a plan skipped, between the plan and the move
MOVE_WINDOW_SLACK = 20_000


def full_size(tokens: str | None, full: str | None) -> float:
    """A queued row's full size (prompt + predicted response, no prefix discount) from its hash's ``tokens``
    (its charge) and :data:`workqueue.keys.FULL_TOKENS`: what it needs on any cluster it moves to. A row
    written before the field existed has none: its ``tokens``."""
    charged = as_float(tokens)
    return max(charged, as_float(full, charged))


class Moves:
    """Reads of the queues and moves between them on ``core``'s Redis (``core.clock`` stamps the
    results of :meth:`fail_queued`)."""

    def __init__(self, core: QueueCore) -> None:
        self.core = core
        self.r = core.r
        self._move_tail = core.script(move_scripts.MOVE_TAIL)
        self._move_ids = core.script(move_scripts.MOVE_IDS)
        self._fail_ids = core.script(move_scripts.FAIL_IDS)

    def mover_lease(self, owner: str, ttl_s: float = 30.0, wait_s: float = 0.0) -> MoverLease:
        """The lease every mover (offloader, rebalance, any gateway replica) holds while it plans and
        moves: ``with queue.mover_lease("offloader") as held: ...`` (see :mod:`workqueue.mover`)."""
        return MoverLease(self.r, owner, ttl_s, wait_s)

    def move_tail(self, src: str, dst: str, n: int) -> tuple[int, float]:
        """Atomically move up to ``n`` not-yet-started queries from the back of ``src``'s queue to ``dst``'s;
        returns (moved, tokens charged on ``dst``: their full sizes)."""
        if src == dst or n <= 0:
            return 0, 0.0
        moved, tokens = self._move_tail(
            keys=[keys.queue(src), keys.queue(dst), keys.pending(src), keys.pending(dst)], args=[src, dst, n]
        )
        if int(moved):
            announce(self.r, [dst])
        return int(moved), float(tokens)

    def move_ids(
        self, src: str, dst: str, gids: Sequence[str], window: int | None = None
    ) -> tuple[int, float]:
        """Atomically move exactly those of ``gids`` still queued on ``src`` to the back of ``dst``'s
        queue, in their order on ``src``; returns (moved, tokens charged on ``dst``: their full sizes,
        :data:`workqueue.keys.FULL_TOKENS`, as ``dst``'s prefix cache holds none of their prompts).

        Movers plan from a read of a queue's tail (:meth:`tail`) and move later: queries may
        have been claimed or appended meanwhile, and only the planned ones move. The script
        looks for them from the back of ``src``'s queue and stops once all are found or
        ``window`` entries were seen (default: ``len(gids)`` plus :data:`MOVE_WINDOW_SLACK`);
        planned ids further from the back stay for a later round."""
        gids = list(gids)
        if src == dst or not gids:
            return 0, 0.0
        window = len(gids) + MOVE_WINDOW_SLACK if window is None else window
        moved, tokens = self._move_ids(
            keys=[keys.queue(src), keys.queue(dst), keys.pending(src), keys.pending(dst)],
            args=[src, dst, max(1, int(window)), *gids],
        )
        if int(moved):
            announce(self.r, [dst])
        return int(moved), float(tokens)

    def fail_queued(self, cluster: str, results: Mapping[str, QueryResult], window: int | None = None) -> int:
        """Fail those of the queries ``results`` names (gid -> its failed result) still queued on
        ``cluster``: each leaves the queue and the ``pending`` counter and gets its result once, as
        :meth:`complete` writes it. They are looked for as :meth:`move_ids` looks for its ids (from
        the back, ``window`` entries). Returns how many were failed."""
        bad = [g for g, r in results.items() if r.outcome.state != QueryState.FAILED]
        if bad:
            raise ValueError(f"fail_queued takes failed results only: {', '.join(bad[:5])}")
        if not results:
            return 0
        window = len(results) + MOVE_WINDOW_SLACK if window is None else window
        args: list[str | int | float] = [cluster, max(1, int(window)), self.core.clock()]
        for g, r in results.items():
            args += [g, r.to_json()]
        return int(self._fail_ids(keys=[keys.queue(cluster), keys.pending(cluster)], args=args))

    def tail(self, cluster: str, n: int, skip: int = 0) -> list[tuple[str, float]]:
        """The last ``n`` queued query ids of a cluster before its last ``skip`` (back of the queue
        last) with their full sizes (:func:`full_size`)."""
        gids = self.r.zrange(keys.queue(cluster), -(skip + n), -(skip + 1)) if n > 0 else []
        if not gids:
            return []
        pipe = self.r.pipeline(transaction=False)
        for g in gids:
            pipe.hmget(keys.query(g), "tokens", keys.FULL_TOKENS)
        return [(g, full_size(*h)) for g, h in zip(gids, pipe.execute(), strict=True)]

    def queued_ids(self, cluster: str) -> list[str]:
        return self.r.zrange(keys.queue(cluster), 0, -1)

    def inflight_ids(self, cluster: str) -> list[str]:
        return self.r.zrange(keys.inflight(cluster), 0, -1)

    def tails(self, reads: Mapping[str, tuple[int, int]]) -> dict[str, list[tuple[str, float]]]:
        """:meth:`tail` of many clusters (``cluster -> (n, skip)``) in two round trips: each cluster's
        last ``n`` queued ids before its last ``skip``, with their full sizes (:func:`full_size`)."""
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
                pipe.hmget(keys.query(g), "tokens", keys.FULL_TOKENS)
        sizes = iter(pipe.execute())
        for c in names:
            out[c] = [(g, full_size(*next(sizes))) for g in ids[c]]
        return out

    def move_many(self, moves: Sequence[tuple[str, str, Sequence[str], int]]) -> list[tuple[int, float]]:
        """:meth:`move_ids` of many moves ``(src, dst, gids, window)``, in order, in one pipeline (each
        move stays one atomic script call), then one announcement of the clusters that got work;
        returns each move's ``(moved, tokens charged on its destination)``."""
        calls = [
            ScriptCall(
                self._move_ids,
                [keys.queue(s), keys.queue(d), keys.pending(s), keys.pending(d)],
                [s, d, max(1, int(w)), *g],
            )
            for s, d, g, w in moves
        ]
        replies = execute(self.r, calls)
        out = [(int(m), float(t)) for m, t in replies]
        announce(self.r, [d for (_, d, _, _), (m, _) in zip(moves, out, strict=True) if m])
        return out
