"""Outer search of the planner: tensor-parallel groupings, device orders (up to symmetry),
micro-batch sizes, and the methods that fill in layers and bit widths (ILP, bit-width transfer, adabits).

Each node's same-type devices may be cut into tensor-parallel groups of 1, 2 or 4 devices
(``tp_groupings``); each group is one stage unit, and the orders are ordered subsets of one
grouping's units.

Device orders are ordered subsets of the cluster's devices, deduplicated by their signature
(device type of each stage, link bandwidth between consecutive stages), so devices of one type
on one node are interchangeable. Orders that cannot hold the model at the lowest bit width are
dropped. Each (order, prefill micro-batch, decode micro-batch) combination is scored with
adabits; the ILP then runs on the best-ranked combinations, warm-started from the heuristic
plan and bounded by the best objective found so far, under an overall time limit.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from planner.costs import Assignment, Evaluation, Problem
from planner.heuristics import adabits, best_kappa, bitwidth_transfer
from planner.ilp import default_group_size, solve_order

log = logging.getLogger(__name__)

METHODS = ("ilp", "transfer", "adabits")
MAX_ENUMERATED_DEVICES = 7


def _signature(problem: Problem, order: tuple[int, ...]) -> tuple:
    c = problem.cluster
    types = tuple((c.devices[problem.unit_devices(u)[0]].type.name, problem.unit_tp(u)) for u in order)
    links = tuple(problem.link_bytes_per_s(a, b) for a, b in itertools.pairwise(order))
    return types, links


def _partitions(n: int, sizes: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Ways to write ``n`` as a non-increasing sum of ``sizes``."""
    out: list[tuple[int, ...]] = []

    def rec(left: int, top: int, acc: tuple[int, ...]) -> None:
        if left == 0:
            out.append(acc)
            return
        for t in sorted(sizes, reverse=True):
            if t <= top and t <= left:
                rec(left - t, t, (*acc, t))

    rec(n, max(sizes), ())
    return out


def tp_groupings(problem: Problem, tp_sizes: Sequence[int] = (1,)) -> list[tuple[int, ...]]:
    """Ways to cut the cluster into stage units: every node's devices of one type are split into
    tensor-parallel groups of the sizes in ``tp_sizes`` (1 always allowed; larger only where the model
    splits evenly). Devices of one type on one node are interchangeable, so one grouping per
    multiset of sizes. Returns tuples of unit ids; the first is all single devices."""
    sizes = tuple(sorted({1} | {t for t in tp_sizes if t > 1 and problem.tp_allowed(t)}))
    pools: dict[tuple[str, str], list[int]] = {}
    for i, d in enumerate(problem.cluster.devices):
        pools.setdefault((d.node, d.type.name), []).append(i)
    per_pool = []
    for devs in pools.values():
        opts = []
        for part in sorted(_partitions(len(devs), sizes), key=len, reverse=True):
            units, at = [], 0
            for t in part:
                units.append(problem.tp_unit(devs[at : at + t]))
                at += t
            opts.append(units)
        per_pool.append(opts)
    out = []
    for combo in itertools.product(*per_pool):
        units = sorted(u for pool in combo for u in pool)
        out.append(tuple(units))
    return out


def device_orders(
    problem: Problem, tp_sizes: Sequence[int] = (1,), stages: int | None = None
) -> list[tuple[int, ...]]:
    """Distinct orders of stage units (ordered subsets, up to symmetry) that could hold the model.

    ``tp_sizes`` = (1,) is pipeline parallelism only (every unit one device, as the baselines use);
    with larger sizes every tensor-parallel grouping of ``tp_groupings`` contributes its orders.
    """
    raw_iters = []
    for units in tp_groupings(problem, tp_sizes):
        n = len(units)
        if n <= MAX_ENUMERATED_DEVICES:
            raw_iters.append(p for k in range(1, n + 1) for p in itertools.permutations(units, k))
        else:
            log.warning("%d stage units: searching only the listed order and its reverse", n)
            raw_iters.append(iter([tuple(units), tuple(reversed(units))]))
    raw = itertools.chain(*raw_iters)
    lo = min(problem.bits)
    need_layers = problem.layers * problem.layer_bytes(lo)
    seen: set = set()
    out = []
    for order in raw:
        if len(order) > problem.layers or (stages is not None and len(order) != stages):
            continue
        sig = _signature(problem, order)
        if sig in seen:
            continue
        seen.add(sig)
        S = len(order)
        room = [problem.stage_room(d, S, k, 1, 1) for k, d in enumerate(order)]
        if min(room) < problem.layer_bytes(lo) or sum(room) < need_layers:
            continue
        out.append(order)
    return out


def micro_batch_candidates(problem: Problem, stages: int) -> list[tuple[int, int]]:
    """(prefill micro-batch size, decode micro-batch size) pairs to try for a ``stages``-stage pipeline."""
    B = problem.workload.batch
    vp = sorted({v for v in (1, 2, 4, 8, 16) if v <= B} | ({B} if B < 16 else set()))
    counts = {m for m in (1, stages - 1, stages, stages + 1, 2 * stages) if 1 <= m <= B}
    vd = sorted({math.ceil(B / m) for m in counts})
    return [(p, d) for p in vp for d in vd]


MIN_CHUNK_TOKENS = 64


def prefill_chunk_candidates(problem: Problem, options: tuple[int, ...] = (1, 2, 4, 8)) -> list[int]:
    """Numbers of prefill chunks kappa to try: chunks of at least ``MIN_CHUNK_TOKENS`` prompt tokens."""
    s = problem.workload.prompt_len
    return sorted({1} | {k for k in options if k >= 1 and s / k >= MIN_CHUNK_TOKENS})


@dataclass
class SearchResult:
    method: str
    assignment: Assignment
    evaluation: Evaluation
    solve_seconds: float
    stats: dict = field(default_factory=dict)


def _ok(e: Evaluation | None, budget: float | None) -> bool:
    return e is not None and e.fits and (budget is None or e.omega <= budget * (1 + 1e-12))


@dataclass(frozen=True)
class SearchBudget:
    """How :func:`plan` spends its wall-clock limit: each phase ends at a fraction of ``limit_s`` after ``start``.

    - ``heuristic`` (0.35): polishing the heuristic plans (the baselines' and the best-ranked
      adabits plans) with bit-width transfer stops here, so the ILP keeps most of the time. Without
      an ILP (methods ``transfer`` and ``adabits``) the polish may use the whole limit.
    - ``grouped_ilp`` (0.6): the ILP over groups of layers stops starting solves here when a
      layer-by-layer refinement follows, leaving it about a third of the ILP time; without a
      refinement the grouped ILP runs until ``ilp``.
    - ``ilp`` (0.9): every ILP solve (grouped or refining) ends by here; the last tenth is kept for
      the final polish of the best plan (bit-width transfer and the number of prefill chunks),
      which ends at the limit.
    """

    start: float
    limit_s: float
    heuristic: float = 0.35
    grouped_ilp: float = 0.6
    ilp: float = 0.9

    def at(self, fraction: float) -> float:
        return self.start + fraction * self.limit_s

    def heuristic_end(self, method: str) -> float:
        return self.at(self.heuristic if method == "ilp" else 1.0)

    def grouped_ilp_end(self, refine: bool) -> float:
        return self.at(self.grouped_ilp if refine else self.ilp)


Key = tuple  # (order, prefill micro-batch, decode micro-batch, kappa): one combination
Ranked = list[tuple[tuple[int, float], Key, Assignment | None]]


@dataclass
class _Search:
    """One :func:`plan` call's options and the best plan found so far (within the omega cap)."""

    problem: Problem
    method: str
    omega_budget: float | None
    exhaustive: bool
    kappas: list[int]
    stats: dict
    best: tuple[Assignment, Evaluation] | None = None

    def keep(self, a: Assignment, e: Evaluation | None) -> bool:
        """Make ``a`` the best plan when it fits the omega cap and beats it; True when it fits."""
        ok = _ok(e, self.omega_budget)
        if ok and (self.best is None or e.objective < self.best[1].objective):
            self.best = (a, e)
        return ok

    def offer(self, a: Assignment | None, until: float) -> tuple[Assignment, Evaluation] | None:
        """Polish ``a`` (bit-width transfer until ``until``, then kappa) and keep it if best; None if it does not fit."""
        if a is None:
            return None
        if self.method == "adabits":
            a2, e2 = a, self.problem.evaluate(a)
        else:
            deadline = None if self.exhaustive else until
            a2, e2 = bitwidth_transfer(self.problem, a, self.omega_budget, deadline=deadline)
        if len(self.kappas) > 1 and not self.exhaustive and _ok(e2, self.omega_budget):
            a2, e2 = best_kappa(self.problem, a2, self.kappas, self.omega_budget)
        return (a2, e2) if self.keep(a2, e2) else None

    def bound(self) -> float | None:
        """The ILP's upper bound: the best objective so far (none when exhaustive)."""
        return None if (self.best is None or self.exhaustive) else self.best[1].objective

    def result(self, t0: float) -> SearchResult | None:
        if self.best is None:
            return None
        return SearchResult(self.method, self.best[0], self.best[1], time.perf_counter() - t0, self.stats)


def _rank(problem: Problem, combos: list[tuple], ks: list[int], search: _Search) -> Ranked:
    """Phase 1: the adabits plan of every combination, ranked within the omega cap first, then by objective.

    Exhaustive: every kappa is its own combination; otherwise kappa is picked per combination.
    """
    scored: Ranked = []
    per_combo = [[k] for k in ks] if search.exhaustive else [ks]
    for o, vp, vd in combos:
        for kk in per_combo:
            a = adabits(problem, o, vp, vd, kk[0])
            e = problem.evaluate(a) if a is not None else None
            if a is not None and len(kk) > 1:
                a, e = best_kappa(problem, a, kk)
            if e is None or not e.fits:
                key = (2, math.inf)
            else:
                key = (int(search.omega_budget is not None and e.omega > search.omega_budget), e.objective)
            scored.append((key, (o, vp, vd, a.kappa if a is not None else kk[0]), a))
    scored.sort(key=lambda t: t[0])
    return scored


def _polish(search: _Search, ranked: Ranked, until: float) -> dict[Key, Assignment]:
    """Phase 2: polish the best-ranked heuristic plans; the polished ones warm-start the ILP."""
    hints: dict[Key, Assignment] = {}
    for _, key, a in ranked:
        r = search.offer(a, until)
        if r is not None:
            hints[key] = r[0]
    return hints


def _grouped_ilp(
    search: _Search, todo: Ranked, hints: dict[Key, Assignment], gs: int, deadline: float, limit_s: float
) -> dict[Key, tuple[float, Assignment]]:
    """Phase 3: the ILP over groups of ``gs`` layers on each combination of ``todo``, until ``deadline``.

    Returns the best known plan per combination (polished heuristic or grouped ILP): the
    candidates a refinement starts from.
    """
    problem, stats, exhaustive = search.problem, search.stats, search.exhaustive
    per_key = {key: (problem.evaluate(h).objective, h) for key, h in hints.items()}
    for i, (_, key, a) in enumerate(todo):
        left = deadline - time.perf_counter()
        if left <= 0 and not exhaustive:
            stats["stopped_early"] = True
            break
        per = left / max(1, min(len(todo) - i, 3)) if not exhaustive else limit_s
        o, vp, vd, kap = key
        h = hints.get(key, a)
        if h is not None and not exhaustive:
            kap = h.kappa  # polishing may have re-chosen kappa
        r = solve_order(problem, o, vp, vd, gs, per, h, search.bound(), search.omega_budget, kappa=kap)
        stats["ilp_solves"] += 1
        if r.assignment is not None:
            e = problem.evaluate(r.assignment)
            if search.keep(r.assignment, e) and (key not in per_key or e.objective < per_key[key][0]):
                per_key[key] = (e.objective, r.assignment)
    return per_key


def _refine(
    search: _Search, todo: Ranked, per_key: dict[Key, tuple[float, Assignment]], top: int, until: float
) -> None:
    """Phase 4: the layer-granular ILP (group size 1) on the ``top`` best combinations, until ``until``.

    Warm-started from their best known plans; combinations whose grouped ILP found nothing within
    the omega cap (coarse groups can make a tight cap infeasible) follow in heuristic rank order.
    """
    problem, best = search.problem, search.best
    if best is not None:
        b = best[0]
        k0 = (b.order, b.v_prefill, b.v_decode, b.kappa)
        if k0 not in per_key or best[1].objective < per_key[k0][0]:
            per_key[k0] = (best[1].objective, b)
    ranked = [(k, v[1]) for k, v in sorted(per_key.items(), key=lambda kv: kv[1][0])]
    ranked += [(key, a) for _, key, a in todo if key not in per_key and a is not None]
    ranked = ranked[:top]
    for i, (key, h) in enumerate(ranked):
        left = until - time.perf_counter()
        if left <= 0:
            search.stats["refine_stopped_early"] = True
            break
        o, vp, vd, _ = key
        per = left / (len(ranked) - i)
        r = solve_order(problem, o, vp, vd, 1, per, h, search.bound(), search.omega_budget, kappa=h.kappa)
        search.stats["refine_solves"] = search.stats.get("refine_solves", 0) + 1
        if r.assignment is not None:
            search.keep(r.assignment, problem.evaluate(r.assignment))


def plan(
    problem: Problem,
    method: str = "ilp",
    time_limit_s: float = 6.0,
    group_size: int | None = None,
    top_k: int = 6,
    omega_budget: float | None = None,
    exhaustive: bool = False,
    micro_batches: list[tuple[int, int]] | None = None,
    starts: list[Assignment] | None = None,
    kappas: list[int] | None = None,
    refine_top: int = 6,
    tp_sizes: Sequence[int] = (1, 2, 4),
    stages: int | None = None,
) -> SearchResult | None:
    """Best plan by ``method``; ``None`` when nothing fits.

    Phases (time shares: :class:`SearchBudget`): rank every combination by its adabits plan
    (:func:`_rank`); polish the given ``starts`` and the ``top_k`` best-ranked plans (:func:`_polish`;
    method ``adabits`` polishes all and stops, ``transfer`` stops after this); the ILP over layer
    groups (:func:`_grouped_ilp`); with groups larger than one layer, the ``refine_top`` best
    combinations solved again layer by layer, warm-started from their plans (:func:`_refine`);
    last, the best plan polished once more.

    ``exhaustive`` runs the ILP on every (order, micro-batch) combination without the bound
    pruning heuristic ranking (for tests against brute force); ``micro_batches`` fixes the pairs;
    ``starts`` are extra candidate plans (e.g. the baselines') polished and kept as incumbents;
    ``kappas`` the numbers of prefill chunks to consider (default ``prefill_chunk_candidates``;
    ``[1]`` = no chunked prefill). kappa is chosen per (order, micro-batch) on the heuristic plan
    (it changes only the prefill term and the activation memory), fixed in the ILP, and chosen
    again on the final plan. ``tp_sizes`` are the tensor-parallel group sizes a stage may use
    (``(1,)``: pipeline only); ``stages`` keeps only plans with exactly that many pipeline stages
    (``None``: any number).
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    budget = SearchBudget(time.perf_counter(), time_limit_s)
    gs = group_size or default_group_size(problem.layers)
    orders = device_orders(problem, tp_sizes, stages)
    combos = [
        (o, vp, vd) for o in orders for vp, vd in (micro_batches or micro_batch_candidates(problem, len(o)))
    ]
    ks = sorted(set(kappas)) if kappas else prefill_chunk_candidates(problem)
    if any(k < 1 for k in ks):
        raise ValueError(f"prefill chunks must be >= 1, got {ks}")
    stats: dict = {
        "orders": len(orders),
        "combos": len(combos),
        "group_size": gs,
        "ilp_solves": 0,
        "kappas": ks,
        "tp_sizes": sorted(set(tp_sizes)),
    }
    log.info(
        "%s: %d device orders, %d (order, micro-batch) combinations",
        problem.cluster.name,
        len(orders),
        len(combos),
    )
    search = _Search(problem, method, omega_budget, exhaustive, ks, stats)
    scored = _rank(problem, combos, ks, search)
    polish_until = budget.heuristic_end(method)
    for a in starts or []:
        if stages is None or len(a.order) == stages:
            search.offer(a, polish_until)
    if method == "adabits":
        _polish(search, scored, polish_until)
        return search.result(budget.start)
    hints = _polish(search, scored[: max(top_k, 1)], polish_until)
    if method == "transfer":
        return search.result(budget.start)
    todo = scored if exhaustive else scored[:top_k]
    refine = not exhaustive and gs > 1 and refine_top > 0
    per_key = _grouped_ilp(search, todo, hints, gs, budget.grouped_ilp_end(refine), time_limit_s)
    if refine:
        _refine(search, todo, per_key, refine_top, budget.at(budget.ilp))
    if search.best is not None and not exhaustive:
        search.offer(search.best[0], budget.at(1.0))  # polish the ILP plan layer by layer
    return search.result(budget.start)
