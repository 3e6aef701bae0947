"""The ILP against brute force on small instances; memory fit of every plan; theta monotonicity."""

from __future__ import annotations

import itertools
import math

import pytest
from transformers import OPTConfig

from planner.baselines import het, uniform
from planner.cluster import cluster_from_dict, load_cluster
from planner.costs import Assignment, Problem, Workload
from planner.modelshape import ModelShape, load_shape
from planner.problem import build_problem
from planner.search import plan


def small_shape(layers: int) -> ModelShape:
    cfg = OPTConfig(
        hidden_size=5120,
        num_hidden_layers=layers,
        ffn_dim=20480,
        num_attention_heads=40,
        word_embed_proj_dim=5120,
    )
    return ModelShape(f"opt-13b-{layers}l", cfg)


def small_cluster(types_mem: list[tuple[str, float]], inter: float = 100.0):
    return cluster_from_dict(
        {
            "name": "small",
            "inter_node_gbps": inter,
            "nodes": [
                {"name": f"n{i}", "devices": [{"type": t, "memory_gib": m}]}
                for i, (t, m) in enumerate(types_mem)
            ],
        }
    )


def brute_force(
    problem: Problem, v_p: int, v_d: int, omega_budget: float | None = None, kappa: int = 1
) -> float:
    """Minimum objective over every ordered device subset, contiguous split and per-layer bit width."""
    n, L = len(problem.cluster.devices), problem.layers
    best = math.inf
    all_bits = list(itertools.product(problem.bits, repeat=L))
    for S in range(1, min(n, L) + 1):
        for order in itertools.permutations(range(n), S):
            for cuts in itertools.combinations(range(1, L), S - 1):
                bounds = (0, *cuts, L)
                counts = tuple(bounds[i + 1] - bounds[i] for i in range(S))
                for bits in all_bits:
                    e = problem.evaluate(Assignment(order, counts, bits, v_p, v_d, kappa))
                    if e.fits and (omega_budget is None or e.omega <= omega_budget) and e.objective < best:
                        best = e.objective
    return best


CASES = [
    # (devices with memory GiB, layers, bits, theta, micro-batches)
    ([("T4", 9.0), ("V100", 7.0)], 6, (4, 16), 0.5, (4, 8)),
    ([("T4", 6.0), ("V100", 6.0), ("A100", 7.0)], 6, (8, 16), 0.2, (2, 16)),
    ([("P100", 12.0), ("V100", 5.0), ("V100", 5.0)], 5, (3, 8), 2.0, (1, 11)),
    ([("T4", 16.0), ("A100", 40.0)], 8, (4, 8), 0.05, (8, 16)),
]


@pytest.mark.parametrize("case", CASES)
def test_ilp_equals_brute_force(case):
    devices, layers, bits, theta, (vp, vd) = case
    problem = build_problem(
        small_cluster(devices), small_shape(layers), Workload(32, 512, 100, bits=bits, theta=theta)
    )
    expected = brute_force(problem, vp, vd)
    assert math.isfinite(expected), "instance should be feasible"
    r = plan(
        problem, "ilp", group_size=1, exhaustive=True, micro_batches=[(vp, vd)], time_limit_s=20, kappas=[1]
    )
    assert r is not None
    assert r.evaluation.fits
    assert r.evaluation.objective == pytest.approx(expected, rel=1e-6)


def test_ilp_with_prefill_chunks_equals_brute_force():
    """kappa fixed at 2 (chunked prefill): the ILP still finds the brute-force optimum."""
    devices, layers, bits, theta, (vp, vd) = CASES[2]
    problem = build_problem(
        small_cluster(devices), small_shape(layers), Workload(32, 512, 100, bits=bits, theta=theta)
    )
    expected = brute_force(problem, vp, vd, kappa=2)
    r = plan(problem, "ilp", group_size=1, exhaustive=True, micro_batches=[(vp, vd)], kappas=[2])
    assert r is not None and r.assignment.kappa == 2
    assert r.evaluation.objective == pytest.approx(expected, rel=1e-6)


def test_ilp_with_omega_budget_equals_brute_force():
    devices, layers, bits, theta, (vp, vd) = CASES[0]
    problem = build_problem(
        small_cluster(devices), small_shape(layers), Workload(32, 512, 100, bits=bits, theta=0.0)
    )
    budget = 2.5 * min(problem.omega[i][4] for i in range(layers))  # room for about two 4-bit layers
    expected = brute_force(problem, vp, vd, budget)
    r = plan(
        problem,
        "ilp",
        group_size=1,
        exhaustive=True,
        micro_batches=[(vp, vd)],
        omega_budget=budget,
        kappas=[1],
    )
    assert r is not None and r.evaluation.omega <= budget
    assert r.evaluation.objective == pytest.approx(expected, rel=1e-6)


def test_infeasible_cluster_gives_no_plan():
    problem = build_problem(
        small_cluster([("T4", 2.0)]), small_shape(6), Workload(32, 512, 100, bits=(4, 16))
    )
    assert plan(problem, "ilp", group_size=1) is None
    assert uniform(problem) is None and het(problem) is None


def test_larger_theta_never_gives_larger_omega():
    devices, layers, bits, _, (vp, vd) = CASES[1]
    omegas = []
    for theta in (0.0, 0.01, 0.1, 1.0, 10.0, 1000.0):
        problem = build_problem(
            small_cluster(devices), small_shape(layers), Workload(32, 512, 100, bits=bits, theta=theta)
        )
        r = plan(problem, "ilp", group_size=1, exhaustive=True, micro_batches=[(vp, vd)], kappas=[1])
        omegas.append(r.evaluation.omega)
    assert all(b <= a * (1 + 1e-9) for a, b in itertools.pairwise(omegas)), omegas
    assert omegas[0] > omegas[-1]  # the knob does something on this instance


@pytest.mark.parametrize("cluster", ["3xT4+V100", "4xT4+2xV100", "3xP100+V100"])
def test_every_method_plan_fits_memory(cluster):
    problem = build_problem(load_cluster(cluster), load_shape("opt-30b"), Workload(32, 512, 100, theta=0.5))
    results = [plan(problem, m, time_limit_s=3) for m in ("adabits", "transfer", "ilp")]
    results += [f(problem) for f in (uniform, het)]
    for r in results:
        if r is None:
            continue
        e = r.evaluation if hasattr(r, "evaluation") else r[1]
        assert e.fits
        assert all(m <= c for m, c in zip(e.stage_memory_bytes, e.stage_capacity_bytes, strict=True))
    ilp = results[2]
    assert ilp is not None
    # the ILP (warm-started from the heuristics) is never worse than them
    assert ilp.evaluation.objective <= min(r.evaluation.objective for r in results[:2] if r) * (1 + 1e-9)
