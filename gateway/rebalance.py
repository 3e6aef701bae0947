"""`gateway rebalance` planning: the queue moves that equalise expected finish times.

:func:`plan_rebalance` works in two phases on a copy of the state:

1. **Drain.** Every cluster named in ``drain`` or not accepting work gives away *all* its
   queued (not started) queries. They go, back of the queue first, to the accepting
   clusters in proportion to each one's water-filling share (the capacity-aware target of
   :func:`gateway.policies.water_fill_targets`), in contiguous runs so there are few moves,
   and only where they fit (per-query KV limit). A query that fits nowhere raises
   :class:`~gateway.policies.NoClusterError`.
2. **Balance.** :func:`balance_targets` gives each accepting cluster the final load that
   equalises finish times when only queued work can move (running work stays). Clusters
   above target give tails (:func:`gateway.offload.tail_move`, each ending within half a
   query of the gap) to clusters below target, least busy first, and only where the move
   pays (queueing delay saved > transfer cost) and fits. Donor and taker roles are fixed
   up front, so nothing moves twice and the loop ends.

Moves are applied in list order; each takes ``count`` queries from the back of ``src``'s
queue *at that moment* and appends them, in their original relative order, to the back of
``dst``'s queue (:func:`simulate_moves` is the reference). Running work is never moved:
``pending_tokens`` counts it, ``queued`` does not. Adding a cluster is a rebalance with a
new empty :class:`ClusterView`; removing one is ``drain``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection, Mapping, Sequence

from gateway.offload import LinkCost, Links, Move, link_cost, tail_move
from gateway.policies import ClusterView, NoClusterError, QueryLoad, water_fill_targets


def expected_finish_s(c: ClusterView, extra_tokens: float = 0.0) -> float:
    """Seconds until ``c`` finishes its pending work plus ``extra_tokens`` (``inf`` with work and no capacity)."""
    work = c.pending_tokens + extra_tokens
    if work <= 0:
        return 0.0
    return work / c.capacity_tps if c.capacity_tps > 0 else math.inf


def _check(
    clusters: Sequence[ClusterView], queued: Mapping[str, Sequence[QueryLoad]], drain: Collection[str]
):
    names = [c.name for c in clusters]
    if len(set(names)) != len(names):
        raise ValueError(
            f"duplicate cluster names: {', '.join(sorted({n for n in names if names.count(n) > 1}))}"
        )
    unknown = sorted(set(queued) - set(names))
    if unknown:
        raise ValueError(f"queued work for unknown clusters: {', '.join(unknown)}")
    unknown = sorted(set(drain) - set(names))
    if unknown:
        raise ValueError(f"cannot drain unknown clusters: {', '.join(unknown)}; known: {', '.join(names)}")


def _append(moves: list[Move], src: str, dst: str, count: int, tokens: float) -> None:
    if moves and moves[-1].src == src and moves[-1].dst == dst:
        last = moves[-1]
        moves[-1] = Move(src, dst, last.count + count, last.tokens + tokens)
    else:
        moves.append(Move(src, dst, count, tokens))


class _State:
    """Mutable working copy: views by name and queues (front first)."""

    def __init__(self, clusters: Sequence[ClusterView], queued: Mapping[str, Sequence[QueryLoad]]) -> None:
        self.order = [c.name for c in clusters]
        self.views = {c.name: c for c in clusters}
        self.queues = {c.name: list(queued.get(c.name, ())) for c in clusters}

    def move(self, src: str, dst: str, count: int) -> float:
        q = self.queues[src]
        if not 0 < count <= len(q):
            raise ValueError(f"move of {count} queries from {src!r}, which has {len(q)} queued")
        block = q[len(q) - count :]
        del q[len(q) - count :]
        self.queues[dst].extend(block)
        tokens = math.fsum(x.total_tokens for x in block)
        s, d = self.views[src], self.views[dst]
        self.views[src] = dataclasses.replace(
            s, pending_tokens=max(0.0, s.pending_tokens - tokens), queue_length=max(0, s.queue_length - count)
        )
        self.views[dst] = dataclasses.replace(
            d, pending_tokens=d.pending_tokens + tokens, queue_length=d.queue_length + count
        )
        return tokens


def simulate_moves(
    clusters: Sequence[ClusterView], queued: Mapping[str, Sequence[QueryLoad]], moves: Sequence[Move]
) -> tuple[list[ClusterView], dict[str, list[QueryLoad]]]:
    """The cluster views and queues after applying ``moves`` in order (``ValueError`` on an impossible move)."""
    _check(clusters, queued, ())
    state = _State(clusters, queued)
    for m in moves:
        if m.src not in state.views or m.dst not in state.views:
            raise ValueError(f"move {m.src!r} -> {m.dst!r} names an unknown cluster")
        state.move(m.src, m.dst, m.count)
    return [state.views[n] for n in state.order], state.queues


def plan_rebalance(
    clusters: Sequence[ClusterView],
    queued: Mapping[str, Sequence[QueryLoad]],
    drain: Collection[str] = (),
    links: Links = LinkCost(),
    bytes_per_query: Callable[[QueryLoad], int] | None = None,
) -> list[Move]:
    """Moves (from the back of queues) that equalise expected finish times; drained clusters empty their queues."""
    _check(clusters, queued, drain)
    state = _State(clusters, queued)
    drained = [c.name for c in clusters if c.name in set(drain) or not c.accepting]
    receivers = [c.name for c in clusters if c.usable and c.name not in set(drained)]
    moves: list[Move] = []

    for src in drained:
        queue = state.queues[src]
        if not queue:
            continue
        if not receivers:
            raise NoClusterError(f"cannot drain {src!r}: no other cluster accepts work")
        views = [state.views[n] for n in receivers]
        deficit = dict(
            zip(receivers, water_fill_targets(views, math.fsum(q.total_tokens for q in queue)), strict=True)
        )
        current: str | None = None
        run = 0
        for q in reversed(list(queue)):
            if current is None or deficit[current] <= 0 or not state.views[current].fits(q):
                fitting = [n for n in receivers if state.views[n].fits(q)]
                if not fitting:
                    raise NoClusterError(
                        f"cannot drain {src!r}: query {q.key!r} needs {q.total_tokens:g} tokens and fits on no accepting cluster"
                    )
                nxt = max(fitting, key=lambda n: deficit[n])
                if nxt != current and run:
                    _append(moves, src, current, run, state.move(src, current, run))
                    run = 0
                current = nxt
            run += 1
            deficit[current] -= q.total_tokens
        if run:
            _append(moves, src, current, run, state.move(src, current, run))

    if len(receivers) > 1:
        _balance(state, receivers, links, bytes_per_query, moves)
    return moves


def balance_targets(views: Sequence[ClusterView], queued_tokens: Sequence[float]) -> list[float]:
    """Final pending tokens per cluster that equalise finish times when only queued work can move.

    Running work (``pending - queued``) stays put, so each cluster's load is at least that
    floor; the rest is water-filled over capacity.
    """
    floors = [
        dataclasses.replace(v, pending_tokens=max(0.0, v.pending_tokens - t))
        for v, t in zip(views, queued_tokens, strict=True)
    ]
    movable = math.fsum(v.pending_tokens for v in views) - math.fsum(f.pending_tokens for f in floors)
    return [
        f.pending_tokens + t
        for f, t in zip(floors, water_fill_targets(floors, max(0.0, movable)), strict=True)
    ]


def _balance(
    state: _State,
    receivers: Sequence[str],
    links: Links,
    bytes_per_query: Callable[[QueryLoad], int] | None,
    moves: list[Move],
) -> None:
    views = [state.views[n] for n in receivers]
    queued_tokens = [math.fsum(q.total_tokens for q in state.queues[n]) for n in receivers]
    target = dict(zip(receivers, balance_targets(views, queued_tokens), strict=True))
    # Roles are fixed up front (donors above target, takers below), so no query moves twice.
    excess = {n: state.views[n].pending_tokens - target[n] for n in receivers}
    donors = sorted((n for n in receivers if excess[n] > 0), key=lambda n: (-excess[n], n))
    takers = [n for n in receivers if excess[n] < 0]
    for donor in donors:
        while state.queues[donor] and excess[donor] > 0:
            open_takers = sorted(
                (n for n in takers if excess[n] < 0), key=lambda n: (expected_finish_s(state.views[n]), n)
            )
            move = None
            for taker in open_takers:
                move = tail_move(
                    state.views[donor],
                    state.views[taker],
                    state.queues[donor],
                    link_cost(links, donor, taker),
                    bytes_per_query,
                    max_tokens=min(excess[donor], -excess[taker]),
                )
                if move is not None:
                    break
            if move is None:
                break
            tokens = state.move(move.src, move.dst, move.count)
            excess[donor] -= tokens
            excess[move.dst] += tokens
            _append(moves, move.src, move.dst, move.count, tokens)


def format_plan(before: Sequence[ClusterView], after: Sequence[ClusterView], moves: Sequence[Move]) -> str:
    """A plain-text table of pending tokens, capacity and expected finish before/after, then the moves."""
    after_by = {c.name: c for c in after}
    lines = [
        f"{'cluster':<16} {'capacity_tps':>12} {'pending':>12} {'finish_s':>10} {'pending_after':>14} {'finish_after_s':>14}"
    ]
    for c in before:
        a = after_by.get(c.name, c)
        flag = "" if c.accepting else "  (not accepting)"
        lines.append(
            f"{c.name:<16} {c.capacity_tps:>12.1f} {c.pending_tokens:>12.0f} {expected_finish_s(c):>10.1f} "
            f"{a.pending_tokens:>14.0f} {expected_finish_s(a):>14.1f}{flag}"
        )
    if not moves:
        lines.append("no moves: expected finish times are as equal as paying moves can make them")
    for m in moves:
        lines.append(f"move {m.count} queries ({m.tokens:.0f} tokens) from the back of {m.src} to {m.dst}")
    return "\n".join(lines)
