"""`fleetbatch gateway rebalance` planning: the queue moves that equalise expected finish times.

:func:`plan_moves` works in two phases on a copy of the state:

1. **Drain.** Every cluster named in ``drain`` or not accepting work gives away its queued
   (not started) queries. They go, back of the queue first, to the accepting clusters in
   proportion to each one's water-filling share (the capacity-aware target of
   :func:`gateway.assign.policies.water_fill_targets`; under the cost policy its split instead,
   :func:`gateway.assign.cost_moves.evacuation_rules`), in runs so there are few moves, and only
   where they fit (per-query limit and KV budget, against a query's full size: the loads of
   :func:`gateway.assign.views.queued_loads` carry no prefix discount). A query that fits on no
   accepting cluster is *kept*: it stays where it is, the plan lists it
   (:attr:`RebalancePlan.kept`), and the rest of the queue moves past it. With no accepting cluster at all there is nowhere to
   drain to: :class:`~gateway.assign.policies.NoClusterError`.
2. **Balance.** :func:`balance_targets` gives each accepting cluster the final load that
   equalises finish times when only queued work can move (running work stays); under the cost
   policy the final loads are its split of the queued work instead (the drain's ``split``, over what
   each cluster runs), so that a cheaper cluster takes what it finishes within its horizon; such a move
   pays in cost and is made up to the gap whatever the link, where the move rule allows it (a target the
   rule blocks, a cheap cluster's share past its spot margin but within the margin, stays unmet). Clusters
   above target give tails (:func:`gateway.offload.moves.tail_move`, each ending within half a
   query of the gap) to clusters below target, least busy first, and only where the move
   pays (queueing delay saved > transfer cost) and fits (and, under the cost policy, that its
   rule allows). Donor and taker roles are fixed
   up front, so nothing moves twice and the loop ends.

Each :class:`~gateway.offload.moves.Move` names the queries it carries (``keys``, in their order
on ``src``); applying it takes those queries out of ``src``'s queue and appends them, in
that order, to the back of ``dst``'s (:func:`simulate_moves` is the reference; the gateway
moves exactly those ids, skipping any that left the queue meanwhile). Running work is never
moved: ``pending_tokens`` counts it, ``queued`` does not. Adding a cluster is a rebalance
with a new empty :class:`ClusterView`; removing one is ``drain``. :func:`plan_rebalance`
is :func:`plan_moves` without the kept queries.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection, Mapping, Sequence

from gateway.assign.policies import (
    ClusterView,
    NoClusterError,
    QueryLoad,
    expected_finish_s,
    fitting,
    water_fill_targets,
)
from gateway.offload.moves import LinkCost, Links, Move, link_cost, tail_move


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


def _append(moves: list[Move], src: str, dst: str, block: Sequence[QueryLoad], tokens: float) -> None:
    keys = tuple(q.key for q in block)
    if moves and moves[-1].src == src and moves[-1].dst == dst:
        last = moves[-1]  # the new block stood in front of the last one on src
        moves[-1] = Move(src, dst, last.count + len(block), last.tokens + tokens, keys + last.keys)
    else:
        moves.append(Move(src, dst, len(block), tokens, keys))


@dataclasses.dataclass
class RebalancePlan:
    """The moves, and per drained cluster the queries that fit on no accepting cluster and stay."""

    moves: list[Move]
    kept: dict[str, list[QueryLoad]] = dataclasses.field(default_factory=dict)

    def kept_lines(self) -> list[str]:
        """One line per drained cluster that keeps queries, naming them (the first 10)."""
        lines = []
        for src, kept in sorted(self.kept.items()):
            names = ", ".join(repr(q.key) for q in kept[:10]) + (", ..." if len(kept) > 10 else "")
            lines.append(
                f"{src} keeps {len(kept)} queued quer{'y' if len(kept) == 1 else 'ies'} that fit on no "
                f"accepting cluster: {names}"
            )
        return lines


class _State:
    """Mutable working copy: views by name and queues (front first)."""

    def __init__(self, clusters: Sequence[ClusterView], queued: Mapping[str, Sequence[QueryLoad]]) -> None:
        self.order = [c.name for c in clusters]
        self.views = {c.name: c for c in clusters}
        self.queues = {c.name: list(queued.get(c.name, ())) for c in clusters}

    def move(self, src: str, dst: str, count: int) -> list[QueryLoad]:
        """Move the last ``count`` queued queries of ``src``; returns them (front first)."""
        q = self.queues[src]
        if not 0 < count <= len(q):
            raise ValueError(f"move of {count} queries from {src!r}, which has {len(q)} queued")
        block = q[len(q) - count :]
        self.move_block(src, dst, block)
        return block

    def move_block(self, src: str, dst: str, block: Sequence[QueryLoad]) -> float:
        """Move these queries (objects of ``src``'s queue, front first) to the back of ``dst``'s; their tokens."""
        chosen = {id(x) for x in block}
        q = self.queues[src]
        self.queues[src] = [x for x in q if id(x) not in chosen]
        if len(self.queues[src]) != len(q) - len(block):
            raise ValueError(f"move of queries that are not queued on {src!r}")
        self.queues[dst].extend(block)
        tokens = math.fsum(x.total_tokens for x in block)
        count = len(block)
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
    """The cluster views and queues after applying ``moves`` in order (``ValueError`` on an impossible move).

    A move with ``keys`` carries those queries; one without carries the back ``count`` of ``src``."""
    _check(clusters, queued, ())
    state = _State(clusters, queued)
    for m in moves:
        if m.src not in state.views or m.dst not in state.views:
            raise ValueError(f"move {m.src!r} -> {m.dst!r} names an unknown cluster")
        if not m.keys:
            state.move(m.src, m.dst, m.count)
            continue
        by_key = {q.key: q for q in state.queues[m.src]}
        missing = [k for k in m.keys if k not in by_key]
        if missing or len(m.keys) != m.count:
            raise ValueError(f"move {m.src!r} -> {m.dst!r} names queries not queued there: {missing[:5]}")
        state.move_block(m.src, m.dst, [by_key[k] for k in m.keys])
    return [state.views[n] for n in state.order], state.queues


def plan_rebalance(
    clusters: Sequence[ClusterView],
    queued: Mapping[str, Sequence[QueryLoad]],
    drain: Collection[str] = (),
    links: Links = LinkCost(),
    bytes_per_query: Callable[[QueryLoad], int] | None = None,
) -> list[Move]:
    """The moves of :func:`plan_moves` (queries that fit nowhere stay where they are)."""
    return plan_moves(clusters, queued, drain, links, bytes_per_query).moves


#: how a drained queue is shared over the receivers (their views, its queries): a target in tokens each
Split = Callable[[Sequence[ClusterView], Sequence[QueryLoad]], list[float]]
#: whether a move from the first cluster to the second may be made (None: every paying move)
Allowed = Callable[[ClusterView, ClusterView], bool]


def _water_fill(views: Sequence[ClusterView], queries: Sequence[QueryLoad]) -> list[float]:
    return water_fill_targets(views, math.fsum(q.total_tokens for q in queries))


def plan_moves(
    clusters: Sequence[ClusterView],
    queued: Mapping[str, Sequence[QueryLoad]],
    drain: Collection[str] = (),
    links: Links = LinkCost(),
    bytes_per_query: Callable[[QueryLoad], int] | None = None,
    split: Split | None = None,
    allowed: Allowed | None = None,
    balance: bool = True,
) -> RebalancePlan:
    """Moves that equalise expected finish times (under the cost policy, that place the queued work by its split);
    drained clusters give away every queued query that fits on an accepting cluster and keep (and report) the
    rest. ``split``: the drain's targets (default the water filling) and, given, the balance's (over the queued
    work of every receiver); ``allowed``: the balance phase makes only the moves it allows (the cost policy's
    :func:`gateway.assign.cost_moves.move_allowed`, and :func:`gateway.assign.cost.cost_split` as its split).
    ``balance=False``: the drain's moves only (the offloader's evacuation)."""
    _check(clusters, queued, drain)
    state = _State(clusters, queued)
    drained = [c.name for c in clusters if c.name in set(drain) or not c.accepting]
    receivers = [c.name for c in clusters if c.usable and c.name not in set(drained)]
    plan = RebalancePlan([])

    for src in drained:
        queue = state.queues[src]
        if not queue:
            continue
        if not receivers:
            raise NoClusterError(f"cannot drain {src!r}: no other cluster accepts work")
        views = [state.views[n] for n in receivers]
        share = split or _water_fill
        deficit = dict(zip(receivers, share(views, queue), strict=True))
        current: str | None = None
        run: list[QueryLoad] = []  # back of the queue first
        for q in reversed(list(queue)):
            fit = [c.name for c in fitting(q, [state.views[n] for n in receivers])]
            if not fit:
                plan.kept.setdefault(src, []).insert(0, q)
                continue
            if current is None or deficit[current] <= 0 or current not in fit:
                nxt = max(fit, key=lambda n: deficit[n])
                if nxt != current and run:
                    _append(plan.moves, src, current, run[::-1], state.move_block(src, current, run[::-1]))
                    run = []
                current = nxt
            run.append(q)
            deficit[current] -= q.total_tokens
        if run:
            _append(plan.moves, src, current, run[::-1], state.move_block(src, current, run[::-1]))

    if balance and len(receivers) > 1:
        _balance(state, receivers, links, bytes_per_query, plan.moves, allowed, split)
    return plan


def balance_targets(views: Sequence[ClusterView], queued_tokens: Sequence[float]) -> list[float]:
    """Final pending tokens per cluster that equalise finish times when only queued work can move.

    Running work (``pending - queued``) stays put, so each cluster's load is at least that
    floor; the rest is water-filled over capacity.
    """
    floors = _floors(views, queued_tokens)
    movable = math.fsum(v.pending_tokens for v in views) - math.fsum(f.pending_tokens for f in floors)
    return [
        f.pending_tokens + t
        for f, t in zip(floors, water_fill_targets(floors, max(0.0, movable)), strict=True)
    ]


def _floors(views: Sequence[ClusterView], queued_tokens: Sequence[float]) -> list[ClusterView]:
    """Each view with only the work that cannot move (its running work: pending less queued)."""
    return [
        dataclasses.replace(v, pending_tokens=max(0.0, v.pending_tokens - t))
        for v, t in zip(views, queued_tokens, strict=True)
    ]


def _balance(
    state: _State,
    receivers: Sequence[str],
    links: Links,
    bytes_per_query: Callable[[QueryLoad], int] | None,
    moves: list[Move],
    allowed: Allowed | None = None,
    split: Split | None = None,
) -> None:
    views = [state.views[n] for n in receivers]
    queued_tokens = [math.fsum(q.total_tokens for q in state.queues[n]) for n in receivers]
    if split is None:
        targets = balance_targets(views, queued_tokens)
    else:  # the cost policy: the queued work as its split would place it, over what each cluster runs
        movable = [q for n in receivers for q in state.queues[n]]
        floors = _floors(views, queued_tokens)
        targets = [f.pending_tokens + x for f, x in zip(floors, split(floors, movable), strict=True)]
    target = dict(zip(receivers, targets, strict=True))
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
                if allowed is not None and not allowed(state.views[donor], state.views[taker]):
                    continue
                move = tail_move(
                    state.views[donor],
                    state.views[taker],
                    state.queues[donor],
                    link_cost(links, donor, taker),
                    bytes_per_query,
                    max_tokens=min(excess[donor], -excess[taker]),
                    until_s=None if split is None else math.inf,  # the split's targets bound the move
                )
                if move is not None:
                    break
            if move is None:
                break
            block = state.move(move.src, move.dst, move.count)
            tokens = math.fsum(q.total_tokens for q in block)
            excess[donor] -= tokens
            excess[move.dst] += tokens
            _append(moves, move.src, move.dst, block, tokens)


def format_plan(
    before: Sequence[ClusterView],
    after: Sequence[ClusterView],
    moves: Sequence[Move],
    kept: Sequence[str] = (),
) -> str:
    """A plain-text table of pending tokens, capacity and expected finish before/after, the moves,
    then ``kept`` (lines naming queries that stay: :meth:`RebalancePlan.kept_lines`)."""
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
        lines.append("no moves: none that pays (and, under the cost policy, that its rule allows) is left")
    for m in moves:
        lines.append(f"move {m.count} queries ({m.tokens:.0f} tokens) from the back of {m.src} to {m.dst}")
    lines.extend(kept)
    return "\n".join(lines)
