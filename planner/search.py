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

    ``exhaustive`` runs the ILP on every (order, micro-batch) combination without the bound
    pruning heuristic ranking (for tests against brute force); ``micro_batches`` fixes the pairs;
    ``starts`` are extra candidate plans (e.g. the baselines') polished and kept as incumbents;
    ``kappas`` the numbers of prefill chunks to consider (default ``prefill_chunk_candidates``;
    ``[1]`` = no chunked prefill). kappa is chosen per (order, micro-batch) on the heuristic plan
    (it changes only the prefill term and the activation memory), fixed in the ILP, and chosen
    again on the final plan. With layer groups larger than one layer, the ``refine_top`` best
    combinations are solved again layer by layer (group size 1), warm-started from their plans.
    ``tp_sizes`` are the tensor-parallel group sizes a stage may use (``(1,)``: pipeline only);
    ``stages`` keeps only plans with exactly that many pipeline stages (``None``: any number).
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    t0 = time.perf_counter()
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

    # rank by the adabits plan: within the omega cap first, then by objective (repair comes later, top-k only)
    scored: list[tuple[tuple[int, float], tuple, Assignment | None]] = []
    # exhaustive: every kappa is its own combination; otherwise kappa is picked per combination
    per_combo = [[k] for k in ks] if exhaustive else [ks]
    for o, vp, vd in combos:
        for kk in per_combo:
            a = adabits(problem, o, vp, vd, kk[0])
            e = problem.evaluate(a) if a is not None else None
            if a is not None and len(kk) > 1:
                a, e = best_kappa(problem, a, kk)
            if e is None or not e.fits:
                key = (2, math.inf)
            else:
                key = (int(omega_budget is not None and e.omega > omega_budget), e.objective)
            scored.append((key, (o, vp, vd, a.kappa if a is not None else kk[0]), a))
    scored.sort(key=lambda t: t[0])

    best: tuple[Assignment, Evaluation] | None = None

    def offer(a: Assignment | None, until: float) -> tuple[Assignment, Evaluation] | None:
        nonlocal best
        if a is None:
            return None
        if method == "adabits":
            a2, e2 = a, problem.evaluate(a)
        else:
            a2, e2 = bitwidth_transfer(problem, a, omega_budget, deadline=None if exhaustive else until)
        if len(ks) > 1 and not exhaustive and _ok(e2, omega_budget):
            a2, e2 = best_kappa(problem, a2, ks, omega_budget)
        if _ok(e2, omega_budget) and (best is None or e2.objective < best[1].objective):
            best = (a2, e2)
        return (a2, e2) if _ok(e2, omega_budget) else None

    # time shares: heuristic polishing, ILP solves, final polish
    t_heur = t0 + (0.35 if method == "ilp" else 1.0) * time_limit_s
    t_ilp = t0 + 0.9 * time_limit_s
    for a in starts or []:
        if stages is None or len(a.order) == stages:
            offer(a, t_heur)

    if method == "adabits":
        for _, _, a in scored:
            if a is not None:
                offer(a, t_heur)
        return _result(method, best, t0, stats)

    hints: dict[tuple, Assignment] = {}
    for _, key, a in scored[: max(top_k, 1)]:
        r = offer(a, t_heur)
        if r is not None:
            hints[key] = r[0]
    if method == "transfer":
        return _result(method, best, t0, stats)

    todo = scored if exhaustive else scored[:top_k]
    refine = not exhaustive and gs > 1 and refine_top > 0
    deadline = t0 + 0.6 * time_limit_s if refine else t_ilp
    # best known plan per combination (polished heuristic or grouped ILP): candidates to refine
    per_key: dict[tuple, tuple[float, Assignment]] = {}
    for key, h in hints.items():
        per_key[key] = (problem.evaluate(h).objective, h)
    for i, (_, key, a) in enumerate(todo):
        left = deadline - time.perf_counter()
        if left <= 0 and not exhaustive:
            stats["stopped_early"] = True
            break
        per = left / max(1, min(len(todo) - i, 3)) if not exhaustive else time_limit_s
        o, vp, vd, kap = key
        h = hints.get(key, a)
        if h is not None and not exhaustive:
            kap = h.kappa  # polishing may have re-chosen kappa
        ub = None if (best is None or exhaustive) else best[1].objective
        r = solve_order(problem, o, vp, vd, gs, per, h, ub, omega_budget, kappa=kap)
        stats["ilp_solves"] += 1
        if r.assignment is not None:
            e = problem.evaluate(r.assignment)
            if _ok(e, omega_budget) and (best is None or e.objective < best[1].objective):
                best = (r.assignment, e)
            if _ok(e, omega_budget) and (key not in per_key or e.objective < per_key[key][0]):
                per_key[key] = (e.objective, r.assignment)
    if refine:
        # layer-granular ILP (group size 1) on the best few combinations, warm-started from their
        # best known plans; combinations whose grouped ILP found nothing within the omega cap
        # (coarse groups can make a tight cap infeasible) follow in heuristic rank order
        if best is not None:
            b = best[0]
            k0 = (b.order, b.v_prefill, b.v_decode, b.kappa)
            if k0 not in per_key or best[1].objective < per_key[k0][0]:
                per_key[k0] = (best[1].objective, b)
        ranked = [(k, v[1]) for k, v in sorted(per_key.items(), key=lambda kv: kv[1][0])]
        ranked += [(key, a) for _, key, a in todo if key not in per_key and a is not None]
        ranked = ranked[:refine_top]
        for i, (key, h) in enumerate(ranked):
            left = t_ilp - time.perf_counter()
            if left <= 0:
                stats["refine_stopped_early"] = True
                break
            o, vp, vd, _ = key
            ub = best[1].objective if best is not None else None
            r = solve_order(
                problem, o, vp, vd, 1, left / (len(ranked) - i), h, ub, omega_budget, kappa=h.kappa
            )
            stats["refine_solves"] = stats.get("refine_solves", 0) + 1
            if r.assignment is not None:
                e = problem.evaluate(r.assignment)
                if _ok(e, omega_budget) and (best is None or e.objective < best[1].objective):
                    best = (r.assignment, e)
    if best is not None and not exhaustive:
        offer(best[0], t0 + time_limit_s)  # polish the grouped ILP plan layer by layer
    return _result(method, best, t0, stats)


def _result(method: str, best, t0: float, stats: dict) -> SearchResult | None:
    if best is None:
        return None
    return SearchResult(method, best[0], best[1], time.perf_counter() - t0, stats)
