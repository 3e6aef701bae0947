"""What the fleet costs, in one place: the billing model, the cost-aware split of a batch (``--policy cost``), and
the rule the offloader's moves follow under it.

**The billing model.** A cluster is billed at its price (:meth:`clusterfile.Cluster.hourly_price`: its
``price_per_hour``, else its devices' catalog prices in its market) from the batch's start until it is released,
and it is released (scaled to zero) as soon as it has no work left; a cluster given no work costs nothing. A
cluster with no known price is billed at nothing. So a cluster of price ``p`` (dollars per second), capacity
``c`` (tokens per second) and ``q`` tokens of work costs ``p * q / c``: ``p / c`` a token (:func:`dollars_per_token`).

**The split** (:func:`cost_targets`). Work is counted in the capacities' unit, generated-token equivalents (a
prompt token at :data:`gateway.assign.loads.PROMPT_WEIGHT` of a generated one; :attr:`QueryLoad.work_tokens`), so
that work over a capacity is a time. For a batch of ``X`` predicted work units (prompts + responses) and the time left
in its completion window ``W``, cluster ``i`` gets ``x_i`` tokens: minimise ``sum p_i (q_i + x_i) / c_i`` subject to
``sum x_i = X`` and every cluster finishing within ``MARGIN x W``, ``(q_i + x_i) / c_i <= MARGIN * W``, where
``q_i`` is the work it already holds (queued and running). Cost and finish times are linear in ``x``, so this is a
linear program (GLOP, OR-Tools): the clusters cheapest per token fill first, each up to what it finishes within the
window. A second LP spreads the batch over clusters of equal price per token so that the fleet finishes earliest
at that least cost. A spot cluster (``market: spot``) must be done within the spot margin (``--spot-margin``,
:data:`SPOT_MARGIN` by default) of the window
instead, so that when it is preempted its work still has time to run on the clusters left; where no split allows
that, within the least more that does (up to the margin of the others). When no split meets the window, the
batch takes the fastest finish (the ``token`` policy's water filling) and is at risk. :class:`CostPolicy` turns
the shares into queries as the ``token`` policy does (longest first, to the largest remaining deficit).

**Moves** under this policy (the offloader's, a drain's) follow :mod:`gateway.assign.cost_moves`.

No Redis of its own (:func:`assign_batch` reads a batch's deadline through the queue it is given); OR-Tools is
imported on the first split.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from clusterfile import Cluster
from gateway.assign.loads import ClusterView, NoClusterError, QueryLoad, usable_clusters, work_per_token
from gateway.assign.policies import deficit_fill, water_fill_targets
from workqueue import ClusterInfo

log = logging.getLogger(__name__)

#: every cluster must finish within this share of the time left in the batch's window (the safety margin)
MARGIN = 0.8
#: a spot cluster's share must be done within this share of the window (an on-demand one's within MARGIN): the
#: rest is room for a preemption, after which its work moves to the clusters left. The default of the gateway's
#: ``--spot-margin``: a fleet whose spot clusters are seldom preempted saves more with a larger one (up to MARGIN)
SPOT_MARGIN = 0.5
#: the window of a batch without a deadline (the queue order keys such a batch as if its window were 24 h)
DEFAULT_WINDOW_S = 24 * 3600.0
_TIE = 1e-9  # the second LP keeps the cost within this share of the least cost (the LP's tolerance)
_SNAP = 1e-6  # a share below this is the solver's rounding: 0
KEEP_AT_RISK = 1000  # batches the policy remembers having logged at risk

#: dollars per hour of each cluster whose price is known, by name
Prices = Mapping[str, float]


def fleet_prices(clusters: Sequence[Cluster]) -> dict[str, float]:
    """The known prices (dollars per hour) of the clusters of a cluster file, by name."""
    return {c.name: p for c in clusters if (p := c.hourly_price()) is not None}


def spot_clusters(clusters: Sequence[Cluster]) -> frozenset[str]:
    """The names of the clusters of a cluster file that run on spot (``market: spot``)."""
    return frozenset(c.name for c in clusters if c.market == "spot")


def holds_work(info: ClusterInfo) -> bool:
    """Whether the billing model bills a cluster now: it holds queued or leased (running) queries."""
    return info.queue_length > 0 or info.inflight > 0


def dollars_per_second(prices: Prices, name: str) -> float:
    """What cluster ``name`` costs a second while it is billed (0: no known price)."""
    return prices.get(name, 0.0) / 3600.0


def dollars_per_token(view: ClusterView, prices: Prices) -> float:
    """What one token costs on ``view`` under the billing model: its price per second over its capacity (0 for
    a cluster with no known price; ``inf`` for one with no capacity)."""
    price = dollars_per_second(prices, view.name)
    if price <= 0:
        return 0.0
    return price / view.capacity_tps if view.capacity_tps > 0 else math.inf


def fleet_cost(views: Sequence[ClusterView], prices: Prices, extra: Sequence[float] | None = None) -> float:
    """Dollars the fleet costs to run what each cluster holds (``pending_tokens``, plus ``extra`` tokens each)
    until it is released, under the billing model; a cluster with nothing costs nothing."""
    extra = extra if extra is not None else [0.0] * len(views)
    return math.fsum(
        (v.pending_tokens + x) * dollars_per_token(v, prices)
        for v, x in zip(views, extra, strict=True)
        if v.pending_tokens + x > 0
    )


@dataclass(frozen=True)
class CostPlan:
    """A batch's split: tokens per cluster (in the order given), whether no split met the window (the fastest
    finish instead: at risk), the fleet's cost with it (dollars, :func:`fleet_cost`: what the clusters held too)
    and the batch's finish (s from now: the latest of the clusters it uses, after what they held)."""

    targets: list[float]
    at_risk: bool
    cost: float
    finish_s: float


def _plan(clusters: Sequence[ClusterView], prices: Prices, targets: list[float], at_risk: bool) -> CostPlan:
    finish = max(
        ((c.pending_tokens + x) / c.capacity_tps for c, x in zip(clusters, targets, strict=True) if x > 0),
        default=0.0,
    )  # fmt: skip
    return CostPlan(targets, at_risk, fleet_cost(clusters, prices, targets), finish)


def cost_targets(
    clusters: Sequence[ClusterView],
    prices: Prices,
    new_tokens: float,
    window_s: float,
    margin: float = MARGIN,
    spot: Collection[str] = (),
    spot_margin: float = SPOT_MARGIN,
) -> CostPlan:
    """The cheapest split of ``new_tokens`` over ``clusters`` (usable, capacity > 0) that has every cluster done
    within ``margin * window_s``, counting what each holds (the LP of the module docstring), and each cluster
    named in ``spot`` within ``spot_margin`` of it (room for a preemption), or the least more a split needs;
    when there is none, the fastest finish (:func:`gateway.assign.policies.water_fill_targets`), at risk."""
    if new_tokens < 0 or not math.isfinite(new_tokens):
        raise ValueError(f"new_tokens must be a finite number >= 0, not {new_tokens}")
    check_margins(margin, spot_margin)
    if any(c.capacity_tps <= 0 for c in clusters):
        raise ValueError("the cost split needs clusters with capacity > 0")
    if not clusters:
        raise ValueError("no clusters given")
    if new_tokens == 0:
        return _plan(clusters, prices, [0.0] * len(clusters), False)
    horizon = margin * max(window_s, 0.0)
    spot_horizon = _spot_horizon(clusters, new_tokens, horizon, spot_margin * max(window_s, 0.0), spot)
    room = _room(clusters, horizon, spot_horizon, spot)
    if math.fsum(room) < new_tokens * (1 - 1e-12):
        return _plan(clusters, prices, water_fill_targets(clusters, new_tokens), True)
    per_token = [dollars_per_token(c, prices) for c in clusters]
    try:
        shares = _solve(per_token, clusters, room, new_tokens, horizon)
    except RuntimeError as e:  # never seen; the first stage's optimum has a closed form, so take that
        log.warning("%s; the cheapest-first fill instead", e)
        shares = _cheapest_first(per_token, room, new_tokens)
    targets = [s * new_tokens for s in shares]
    return _plan(clusters, prices, targets, False)


def cost_split(
    clusters: Sequence[ClusterView],
    prices: Prices,
    tokens: float,
    window_s: float | None,
    work_per_token: float = 1.0,
    margin: float = MARGIN,
    spot: Collection[str] = (),
    spot_margin: float = SPOT_MARGIN,
) -> CostPlan:
    """:func:`cost_targets` for ``tokens`` (prompt + response, as queues count them) worth ``work_per_token`` work
    units each: the capacities count work units a second, so the LP's times (and its cost, price x time) are
    counted in work, and what the clusters hold at the same mix (their rows' prompt shares are not summed). The
    targets come back in tokens, as the token policy's. ``window_s`` None: :data:`DEFAULT_WINDOW_S`."""
    if not work_per_token > 0:
        raise ValueError(f"work_per_token must be > 0, not {work_per_token}")
    views = [replace(c, pending_tokens=c.pending_tokens * work_per_token) for c in clusters]
    window = DEFAULT_WINDOW_S if window_s is None else window_s
    plan = cost_targets(views, prices, tokens * work_per_token, window, margin, spot, spot_margin)
    return replace(plan, targets=[t / work_per_token for t in plan.targets])


def check_margins(margin: float, spot_margin: float) -> None:
    """``ValueError`` unless both margins are in (0, 1] (a spot margin above ``margin`` counts as ``margin``: a spot
    cluster's share is done no later than an on-demand one's)."""
    if not 0 < margin <= 1:
        raise ValueError(f"margin must be in (0, 1], not {margin}")
    if not 0 < spot_margin <= 1:
        raise ValueError(f"the spot margin must be in (0, 1], not {spot_margin}")


def _spot_horizon(
    clusters: Sequence[ClusterView], tokens: float, horizon: float, spot_low: float, spot: Collection[str]
) -> float:
    """The spot clusters' horizon: ``spot_low`` (the spot margin of the window), or the least more (up to the
    margin's ``horizon``) with which the fleet has room for ``tokens`` (room grows with the horizon: a bisection)."""
    low = min(horizon, spot_low)
    if math.fsum(_room(clusters, horizon, low, spot)) >= tokens or not any(c.name in spot for c in clusters):
        return low
    high = horizon
    for _ in range(60):  # to well under a millisecond of any window
        mid = (low + high) / 2
        low, high = (low, mid) if math.fsum(_room(clusters, horizon, mid, spot)) >= tokens else (mid, high)
    return high


def _room(
    clusters: Sequence[ClusterView], horizon: float, spot_horizon: float, spot: Collection[str]
) -> list[float]:
    """The tokens each cluster can take on top of what it holds, done within its horizon."""
    return [
        max(0.0, c.capacity_tps * (spot_horizon if c.name in spot else horizon) - c.pending_tokens)
        for c in clusters
    ]


def _solve(
    per_token: list[float], clusters: Sequence[ClusterView], room: list[float], total: float, horizon: float
) -> list[float]:
    """The LP in shares of ``total`` (well scaled): least cost, then, at that cost, the earliest finish."""
    from ortools.linear_solver import pywraplp  # heavy: only the cost policy needs it

    top = max(per_token) or 1.0
    cost = [p / top for p in per_token]  # in [0, 1]
    solver = pywraplp.Solver.CreateSolver("GLOP")
    s = [solver.NumVar(0.0, min(1.0, r / total), f"s{i}") for i, r in enumerate(room)]
    solver.Add(solver.Sum(s) == 1.0)
    solver.Minimize(solver.Sum([k * v for k, v in zip(cost, s, strict=True)]))
    if solver.Solve() != pywraplp.Solver.OPTIMAL:
        raise RuntimeError("the cost LP found no optimum where one exists")
    least = solver.Objective().Value()
    # the second LP: the same least cost, then the earliest finish (times in units of the horizon)
    solver.Add(solver.Sum([k * v for k, v in zip(cost, s, strict=True)]) <= least + _TIE * max(least, 1.0))
    finish = solver.NumVar(0.0, solver.infinity(), "finish")
    scale = horizon if horizon > 0 else 1.0
    for v, c in zip(s, clusters, strict=True):
        solver.Add(
            v * (total / (c.capacity_tps * scale)) + c.pending_tokens / (c.capacity_tps * scale) <= finish
        )
    solver.Minimize(finish)
    if solver.Solve() != pywraplp.Solver.OPTIMAL:
        raise RuntimeError("the cost LP's second stage found no optimum")
    # the solver's crumbs are 0: a cluster the split leaves out stays released
    shares = [x if x > _SNAP else 0.0 for x in (v.solution_value() for v in s)]
    norm = math.fsum(shares)
    return [x / norm for x in shares]


def _cheapest_first(per_token: list[float], room: list[float], total: float) -> list[float]:
    """The first stage's optimum in closed form (a fractional knapsack): the clusters cheapest per token filled
    first, each up to its room, as shares of ``total``."""
    shares = [0.0] * len(room)
    left = total
    for i in sorted(range(len(room)), key=lambda i: (per_token[i], -room[i])):
        take = min(room[i], left)
        shares[i], left = take / total, left - take
    return shares


class CostPolicy:
    """``--policy cost``: each batch split by :func:`cost_targets` over its window, then query by query as the
    ``token`` policy does (longest first, largest remaining deficit)."""

    name = "cost"
    longest_first = True
    priced = True  # made with the fleet's prices (gateway.assign.registry.make_policy)

    def __init__(
        self,
        prices: Prices | None = None,
        margin: float = MARGIN,
        min_concurrency: int = 1,
        spot: Collection[str] = (),
        spot_margin: float = SPOT_MARGIN,
    ) -> None:
        check_margins(margin, spot_margin)
        self.prices = dict(prices or {})
        self.spot = frozenset(spot)  # the spot clusters, whose shares leave room for a preemption
        self.spot_margin = spot_margin  # a spot cluster's share is done within this share of the window
        self.margin = margin
        self.min_concurrency = min_concurrency
        self._at_risk: OrderedDict[str, None] = OrderedDict()  # batches logged at risk (the newest kept)

    def first_at_risk(self, batch_id: str) -> bool:
        """Whether ``batch_id`` turns at risk now (so that a batch's intake chunks log it once, not each)."""
        if not batch_id:
            return True
        if batch_id in self._at_risk:
            return False
        self._at_risk[batch_id] = None
        if len(self._at_risk) > KEEP_AT_RISK:
            self._at_risk.popitem(last=False)
        return True

    def plan(
        self, queries: Sequence[QueryLoad], clusters: Sequence[ClusterView], window_s: float | None = None
    ) -> CostPlan:
        """The split of ``queries`` over the usable ``clusters`` (in their order) for ``window_s`` seconds left."""
        tokens = math.fsum(q.total_tokens for q in queries)
        per = work_per_token(queries)  # this batch's mix
        return cost_split(
            usable_clusters(clusters),
            self.prices,
            tokens,
            window_s,
            per,
            self.margin,
            self.spot,
            self.spot_margin,
        )

    def assign_within(
        self, queries: Sequence[QueryLoad], clusters: Sequence[ClusterView], window_s: float | None
    ) -> tuple[list[str], CostPlan]:
        """Each query's cluster, and the split it follows."""
        usable = usable_clusters(clusters)
        plan = self.plan(queries, usable, window_s)
        if not queries:
            return [], plan
        chosen = [i for i, t in enumerate(plan.targets) if t > 0] or list(range(len(usable)))
        try:  # the clusters the split uses; a cluster it leaves out stays released (costs nothing)
            idx = deficit_fill(
                queries, [usable[i] for i in chosen], [plan.targets[i] for i in chosen], self.min_concurrency
            )
            return [usable[chosen[i]].name for i in idx], plan
        except NoClusterError:  # a query that fits none of them: every usable cluster, by the same targets
            idx = deficit_fill(queries, usable, plan.targets, self.min_concurrency)
            return [usable[i].name for i in idx], plan

    def assign(self, queries: Sequence[QueryLoad], clusters: Sequence[ClusterView]) -> list[str]:
        """:meth:`assign_within` a window of :data:`DEFAULT_WINDOW_S` (a batch without a deadline)."""
        return self.assign_within(queries, clusters, None)[0]


class Batches(Protocol):
    """Where a batch's deadline is read (a :class:`workqueue.WorkQueue`)."""

    def batch(self, batch_id: str) -> Any: ...

    @property
    def clock(self) -> Callable[[], float]: ...


def assign_batch(
    policy: object,
    queries: Sequence[QueryLoad],
    clusters: Sequence[ClusterView],
    window_s: float | None,
    batch_id: str = "",
    batches: Batches | None = None,
) -> list[str]:
    """Assign a batch's queries with ``policy``, giving the seconds left in its window to a policy that reads it
    (the cost policy): ``window_s``, else what is left to the deadline of batch ``batch_id`` as ``batches`` holds it
    (None: no deadline). A batch no split of which meets its window is logged at risk, as the ETA logs one."""
    within: Callable | None = getattr(policy, "assign_within", None)
    if within is None:
        return policy.assign(queries, clusters)  # type: ignore[attr-defined]
    if window_s is None and batch_id and batches is not None:
        info = batches.batch(batch_id)
        if info is not None and info.deadline > 0:
            window_s = info.deadline - batches.clock()
    names, plan = within(queries, clusters, window_s)
    first = getattr(policy, "first_at_risk", None)
    if plan.at_risk and (first is None or first(batch_id)):
        log.warning(
            "batch %s is at risk: no split finishes within %.0f%% of its window (%.0f s left); the fastest "
            "finish instead, predicted in %.0f s",
            batch_id or "(new)",
            100 * getattr(policy, "margin", MARGIN),
            DEFAULT_WINDOW_S if window_s is None else window_s,
            plan.finish_s,
        )
    return names
