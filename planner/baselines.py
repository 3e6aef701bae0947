"""Baselines, scored by the same cost and memory model as the planner.

* Uniform: the cluster's devices in listed order, an even layer split, one bit width for the
  whole model lowered (16 -> 8 -> 4 -> 3) until every stage fits.
* Het (PipeEdge-style): a split balanced by each device's speed under memory limits, one bit
  width for the whole model lowered until it fits, over the same device orders as the planner.

Both get the same bit options, KV bit width, memory model and cost model as the planner. As
in LLM-PQ's comparison they are not phase-aware: one micro-batch size serves prefill and
decode (the best of the planner's candidate sizes).
"""

from __future__ import annotations

from planner.costs import Assignment, Evaluation, Problem
from planner.heuristics import _layer_weight, _max_layers, balanced_split
from planner.search import device_orders, micro_batch_candidates


def shared_micro_batches(problem: Problem, stages: int) -> list[tuple[int, int]]:
    """(v, v) pairs: every size the planner tries for either phase, used for both."""
    sizes = sorted({v for pair in micro_batch_candidates(problem, stages) for v in pair})
    return [(v, v) for v in sizes]


def _best(problem: Problem, cands: list[Assignment]) -> tuple[Assignment, Evaluation] | None:
    best = None
    for a in cands:
        e = problem.evaluate(a)
        if e.fits and (best is None or e.objective < best[1].objective):
            best = (a, e)
    return best


def uniform(problem: Problem) -> tuple[Assignment, Evaluation] | None:
    order = tuple(range(len(problem.cluster.devices)))
    S, L = len(order), problem.layers
    if L < S:
        return None
    counts = tuple(L // S + (1 if k < L % S else 0) for k in range(S))
    for b in sorted(problem.bits, reverse=True):
        cands = [Assignment(order, counts, (b,) * L, vp, vd) for vp, vd in shared_micro_batches(problem, S)]
        best = _best(problem, cands)
        if best is not None:
            return best
    return None


def het(problem: Problem) -> tuple[Assignment, Evaluation] | None:
    L = problem.layers
    for b in sorted(problem.bits, reverse=True):
        cands = []
        for order in device_orders(problem):
            S = len(order)
            for vp, vd in shared_micro_batches(problem, S):
                maxl = [_max_layers(problem, order, k, b, vp, vd) for k in range(S)]
                w = [_layer_weight(problem, order[k], b, vp, vd) for k in range(S)]
                counts = balanced_split(w, maxl, L)
                if counts is not None:
                    cands.append(Assignment(order, tuple(counts), (b,) * L, vp, vd))
        best = _best(problem, cands)
        if best is not None:
            return best
    return None
