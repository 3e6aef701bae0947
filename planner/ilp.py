"""The phase-aware layer/bit-width assignment ILP for one device order, solved with OR-Tools CP-SAT.

For a fixed device order (stage k runs on ``order[k]``), fixed micro-batch sizes and a fixed
number of prefill chunks kappa (``m_p`` below counts prefill items: micro-batches x kappa), with
layer groups g (runs of consecutive layers that share a device and a bit width):

    x[g,k,b] in {0,1}                      group g on stage k at b bits
    sum_{k,b} x[g,k,b] = 1                 every group placed once
    p[g] = sum_{k,b} k * x[g,k,b]          stage index of group g
    p[0] = 0, p[G-1] = S-1, 0 <= p[g+1] - p[g] <= 1
                                           (errata: the stage index never decreases and grows by
                                            at most one; every stage gets >= 1 group)
    sum_{g,b} x[g,k,b] * n_g * (W_b + KV) + C_k <= cap_k            memory per stage
    P_k = sum_{g,b} x * n_g * tp[k,b] + cp_k ;  Mp >= P_k           prefill stage time, max
    D_k = sum_{g,b} x * n_g * td[k,b] + cd_k ;  Md >= D_k           decode stage time, max
    Z >= sum_k D_k ;  Z >= m_d * Md                                 decode step time
    [optional] sum x * omega[g,b] <= budget
    minimise  sum_k P_k + (m_p - 1) Mp + (n - 1) Z + theta * sum x * omega_norm[g,b]

Times are integers in units of 0.1 us, omega in units of 1e-9 of the normalised total.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from ortools.sat.python import cp_model

from planner.costs import Assignment, Problem

log = logging.getLogger(__name__)

TIME_UNIT_S = 1e-7
OMEGA_UNIT = 1e-9


def layer_groups(layers: int, group_size: int) -> list[tuple[int, int]]:
    """Consecutive ``[start, end)`` runs of ``group_size`` layers (the last may be shorter)."""
    if group_size < 1:
        raise ValueError("group size must be >= 1")
    return [(i, min(i + group_size, layers)) for i in range(0, layers, group_size)]


def default_group_size(layers: int, max_groups: int = 16) -> int:
    return max(1, math.ceil(layers / max_groups))


@dataclass
class IlpResult:
    assignment: Assignment | None
    status: str
    objective_units: int | None
    wall_s: float


def solve_order(
    problem: Problem,
    order: tuple[int, ...],
    v_prefill: int,
    v_decode: int,
    group_size: int = 1,
    time_limit_s: float = 5.0,
    hint: Assignment | None = None,
    upper_bound_s: float | None = None,
    omega_budget: float | None = None,
    workers: int = 1,
    kappa: int = 1,
) -> IlpResult:
    """Optimal assignment for one order and micro-batch pair (``None`` when infeasible or not better than the bound)."""
    groups = layer_groups(problem.layers, group_size)
    G, S = len(groups), len(order)
    bits = problem.bits
    if G < S:
        return IlpResult(None, "too-few-groups", None, 0.0)
    wl = problem.workload
    m_p, m_d = problem.micro_batches(v_prefill) * kappa, problem.micro_batches(v_decode)  # prefill items
    u = TIME_UNIT_S

    model = cp_model.CpModel()
    x = {(g, k, b): model.NewBoolVar(f"x{g}_{k}_{b}") for g in range(G) for k in range(S) for b in bits}
    for g in range(G):
        model.AddExactlyOne(x[g, k, b] for k in range(S) for b in bits)
    p = [sum(k * x[g, k, b] for k in range(S) for b in bits) for g in range(G)]
    model.Add(p[0] == 0)
    model.Add(p[G - 1] == S - 1)
    for g in range(G - 1):
        model.Add(p[g + 1] - p[g] >= 0)
        model.Add(p[g + 1] - p[g] <= 1)

    pre_terms, dec_terms = [], []
    horizon = 0
    for k, dev in enumerate(order):
        room = problem.stage_room(dev, S, k, v_prefill, v_decode, kappa)
        if room <= 0:
            return IlpResult(None, "infeasible", None, 0.0)
        model.Add(
            sum(
                x[g, k, b] * (hi - lo) * problem.layer_bytes(b)
                for g, (lo, hi) in enumerate(groups)
                for b in bits
            )
            <= room
        )
        cp, cd = problem.stage_constants(order, k, v_prefill, v_decode, kappa)
        pk = sum(
            x[g, k, b] * round((hi - lo) * problem.layer_prefill_s(dev, b, v_prefill, kappa) / u)
            for g, (lo, hi) in enumerate(groups)
            for b in bits
        ) + round(cp / u)
        dk = sum(
            x[g, k, b] * round((hi - lo) * problem.layer_decode_s(dev, b, v_decode) / u)
            for g, (lo, hi) in enumerate(groups)
            for b in bits
        ) + round(cd / u)
        pre_terms.append(pk)
        dec_terms.append(dk)
        horizon += round(
            (problem.layers * max(problem.layer_prefill_s(dev, b, v_prefill, kappa) for b in bits) + cp) / u
        ) + round((problem.layers * max(problem.layer_decode_s(dev, b, v_decode) for b in bits) + cd) / u)
    horizon = max(1, horizon) * max(m_p, m_d, 1) + 1
    mp = model.NewIntVar(0, horizon, "Mp")
    md = model.NewIntVar(0, horizon, "Md")
    z = model.NewIntVar(0, horizon, "Z")
    for k in range(S):
        model.Add(mp >= pre_terms[k])
        model.Add(md >= dec_terms[k])
    model.Add(z >= sum(dec_terms))
    model.Add(z >= m_d * md)

    def g_omega(g: int, b: int) -> float:
        lo, hi = groups[g]
        return sum(problem.omega_norm(i, b) for i in range(lo, hi))

    quality = sum(
        x[g, k, b] * round(wl.theta * g_omega(g, b) / u) for g in range(G) for k in range(S) for b in bits
    )
    if omega_budget is not None:
        budget_units = math.floor(omega_budget * problem.omega_scale / OMEGA_UNIT + 1e-6)
        model.Add(
            sum(
                x[g, k, b] * math.ceil(g_omega(g, b) / OMEGA_UNIT - 1e-6)
                for g in range(G)
                for k in range(S)
                for b in bits
            )
            <= budget_units
        )
    objective = sum(pre_terms) + (m_p - 1) * mp + (wl.output_tokens - 1) * z + quality
    if upper_bound_s is not None:
        model.Add(objective <= math.ceil(upper_bound_s / u))
    model.Minimize(objective)

    if (
        hint is not None
        and hint.order == order
        and (hint.v_prefill, hint.v_decode, hint.kappa) == (v_prefill, v_decode, kappa)
    ):
        stage_of = [k for k, n in enumerate(hint.stage_layers) for _ in range(n)]
        for g, (lo, _) in enumerate(groups):
            for k in range(S):
                for b in bits:
                    model.AddHint(x[g, k, b], int(stage_of[lo] == k and hint.bits[lo] == b))

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.05, time_limit_s)
    solver.parameters.num_workers = workers
    status = solver.Solve(model)
    name = solver.StatusName(status)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return IlpResult(None, name.lower(), None, solver.WallTime())
    stage_layers = [0] * S
    layer_bits = [0] * problem.layers
    for g, (lo, hi) in enumerate(groups):
        for k in range(S):
            for b in bits:
                if solver.BooleanValue(x[g, k, b]):
                    stage_layers[k] += hi - lo
                    for i in range(lo, hi):
                        layer_bits[i] = b
    a = Assignment(tuple(order), tuple(stage_layers), tuple(layer_bits), v_prefill, v_decode, kappa)
    return IlpResult(a, name.lower(), int(solver.ObjectiveValue()), solver.WallTime())
