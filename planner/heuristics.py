"""Fast paths: "adabits" (one bit width per device, speed-proportional split) and bit-width transfer (local search).

Both work on a fixed device order and micro-batch pair, score candidates with
``Problem.evaluate`` and return only plans that fit in memory.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace

from planner.costs import Assignment, Evaluation, Problem


def _layer_weight(problem: Problem, dev: int, bits: int, v_p: int, v_d: int, kappa: int = 1) -> float:
    """A layer's contribution to the pipeline bottleneck on ``dev`` (prefill and decode together)."""
    wl = problem.workload
    return problem.micro_batches(v_p) * kappa * problem.layer_prefill_s(dev, bits, v_p, kappa) + (
        wl.output_tokens - 1
    ) * problem.micro_batches(v_d) * problem.layer_decode_s(dev, bits, v_d)


def balanced_split(weights: Sequence[float], max_layers: Sequence[int], layers: int) -> list[int] | None:
    """Layer counts (each >= 1, <= max_layers[k]) minimising max_k n_k * weights[k]; ``None`` if impossible."""
    S = len(weights)
    if any(m < 1 for m in max_layers) or sum(max_layers) < layers or layers < S:
        return None
    lo, hi = 0.0, max(w * layers for w in weights) + 1e-12
    for _ in range(60):
        mid = (lo + hi) / 2
        cap = sum(
            min(m, max(1, int(mid / w) if w > 0 else m)) for w, m in zip(weights, max_layers, strict=True)
        )
        if cap >= layers:
            hi = mid
        else:
            lo = mid
    counts = [min(m, max(1, int(hi / w) if w > 0 else m)) for w, m in zip(weights, max_layers, strict=True)]
    excess = sum(counts) - layers
    # remove surplus layers from the stages that would end up slowest
    while excess > 0:
        k = max((k for k in range(S) if counts[k] > 1), key=lambda k: counts[k] * weights[k])
        counts[k] -= 1
        excess -= 1
    return counts


def _max_layers(
    problem: Problem, order: Sequence[int], k: int, bits: int, v_p: int, v_d: int, kappa: int = 1
) -> int:
    room = problem.stage_room(order[k], len(order), k, v_p, v_d, kappa)
    return max(0, room // problem.layer_bytes(bits))


def adabits(
    problem: Problem, order: tuple[int, ...], v_p: int, v_d: int, kappa: int = 1
) -> Assignment | None:
    """One bit width per device, lowered where memory is short; layers split in proportion to speed."""
    bits = problem.bits
    level = [len(bits) - 1] * len(order)
    while True:
        b = [bits[i] for i in level]
        maxl = [_max_layers(problem, order, k, b[k], v_p, v_d, kappa) for k in range(len(order))]
        w = [_layer_weight(problem, order[k], b[k], v_p, v_d, kappa) for k in range(len(order))]
        counts = balanced_split(w, maxl, problem.layers)
        if counts is not None:
            layer_bits = tuple(b[k] for k, n in enumerate(counts) for _ in range(n))
            return Assignment(tuple(order), tuple(counts), layer_bits, v_p, v_d, kappa)
        # lower the device that is shortest of memory relative to its fair (speed) share
        speed = [1.0 / x if x > 0 else 1e12 for x in w]
        share = [problem.layers * s / sum(speed) for s in speed]
        cands = [k for k in range(len(order)) if level[k] > 0]
        if not cands:
            return None
        k = min(cands, key=lambda k: maxl[k] / max(share[k], 1e-9))
        level[k] -= 1


def bitwidth_transfer(
    problem: Problem,
    start: Assignment,
    omega_budget: float | None = None,
    max_iters: int = 200,
    deadline: float | None = None,
) -> tuple[Assignment, Evaluation]:
    """Hill-climb from ``start``: move a boundary layer between neighbouring stages, or move one
    layer's bit width one level up or down (cheapest quality change first); keep the best fitting move.
    Stops at a local optimum, after ``max_iters`` moves or at ``deadline`` (``time.perf_counter()``).
    """
    bits = problem.bits

    def ok(e: Evaluation) -> bool:
        return e.fits and (omega_budget is None or e.omega <= omega_budget * (1 + 1e-12))

    cur = start
    cur_e = problem.evaluate(cur)
    if omega_budget is not None:
        cur, cur_e = _repair_budget(problem, cur, cur_e, omega_budget)
    for _ in range(max_iters):
        if deadline is not None and time.perf_counter() > deadline:
            break
        best, best_e = None, cur_e
        cands: list[Assignment] = []
        sl = list(cur.stage_layers)
        for k in range(len(sl) - 1):
            for d in (1, -1):
                n = sl.copy()
                n[k] -= d
                n[k + 1] += d
                if min(n) >= 1:
                    cands.append(replace(cur, stage_layers=tuple(n)))
        for lo, hi in cur.layer_ranges():
            for step in (1, -1):
                options = []
                for i in range(lo, hi):
                    j = bits.index(cur.bits[i]) + step
                    if 0 <= j < len(bits):
                        options.append(
                            (problem.omega[i][bits[j]] - problem.omega[i][cur.bits[i]], i, bits[j])
                        )
                if options:
                    _, i, nb = min(options)
                    nbits = list(cur.bits)
                    nbits[i] = nb
                    cands.append(replace(cur, bits=tuple(nbits)))
        for c in cands:
            e = problem.evaluate(c)
            if ok(e) and (e.objective < best_e.objective - 1e-12 or not ok(best_e)):
                best, best_e = c, e
        if best is None:
            break
        cur, cur_e = best, best_e
    return cur, cur_e


def best_kappa(
    problem: Problem, a: Assignment, kappas: Sequence[int], omega_budget: float | None = None
) -> tuple[Assignment, Evaluation]:
    """``a`` with the number of prefill chunks (from ``kappas`` and its own) that scores best and fits."""
    best = (a, problem.evaluate(a))
    for k in kappas:
        if k == a.kappa:
            continue
        c = replace(a, kappa=k)
        e = problem.evaluate(c)
        if e.fits and (not best[1].fits or e.objective < best[1].objective - 1e-12):
            best = (c, e)
    return best


def _repair_budget(
    problem: Problem, a: Assignment, e: Evaluation, budget: float
) -> tuple[Assignment, Evaluation]:
    """Raise bit widths (largest quality gain per added byte first) until omega <= budget, keeping the fit."""
    bits = problem.bits
    while e.omega > budget * (1 + 1e-12):
        options = []
        for i, b in enumerate(a.bits):
            j = bits.index(b)
            if j + 1 < len(bits):
                gain = problem.omega[i][b] - problem.omega[i][bits[j + 1]]
                extra = problem.layer_bytes(bits[j + 1]) - problem.layer_bytes(b)
                options.append((-gain / max(extra, 1), i, bits[j + 1]))
        moved = False
        for _, i, nb in sorted(options):
            nbits = list(a.bits)
            nbits[i] = nb
            c = replace(a, bits=tuple(nbits))
            ce = problem.evaluate(c)
            if ce.fits:
                a, e, moved = c, ce, True
                break
        if not moved:
            break
    return a, e
