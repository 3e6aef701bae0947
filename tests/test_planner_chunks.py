"""Chunked prefill (SplitQuant's kappa): cost, memory and search; robust profiling clocks."""

from __future__ import annotations

from dataclasses import replace

import pytest

from planner.baselines import het
from planner.catalog import device_type
from planner.cluster import load_cluster
from planner.costs import Workload
from planner.heuristics import best_kappa
from planner.latency import fit_profile, roofline_profile
from planner.memory import MemoryModel
from planner.modelshape import load_shape
from planner.problem import build_problem
from planner.profiler import default_clock, profile_local
from planner.search import plan, prefill_chunk_candidates


def test_chunked_prefill_cost_is_conservative():
    """kappa = 1 is the unchunked form; chunking never makes a micro-batch's total layer work smaller."""
    lm = fit_profile(roofline_profile(device_type("V100"), load_shape("opt-13b"), [16]))
    for v, s in ((1, 512), (4, 512), (8, 128)):
        assert lm.prefill_chunked_s(16, v, s, 1) == pytest.approx(lm.prefill_s(16, v, s), rel=1e-12)
        totals = [lm.prefill_chunked_s(16, v, s, k) for k in (1, 2, 4, 8)]
        assert totals == sorted(totals)


def test_chunked_prefill_memory_accounted():
    """A prefill chunk holds s/kappa query tokens against s keys: activations shrink, KV does not."""
    shape = load_shape("opt-13b")
    m = MemoryModel(shape, 32, 512, 100)
    acts = [m.activation_bytes(8, 8, last=False, prefill_chunks=k) for k in (1, 2, 4)]
    assert acts[0] > acts[1] > acts[2]
    # by hand for kappa = 4: 128 query tokens of 8 prompts, scores over 512 keys
    h, heads, a = shape.hidden, shape.heads, 2
    resid = 2 * 8 * 128 * h * a
    attn = 8 * 128 * 3 * h * a + 8 * heads * 128 * 512 * a
    mlp = 8 * 128 * shape.intermediate * a
    assert acts[2] == resid + max(attn, mlp)
    problem = build_problem(load_cluster("3xT4+V100"), shape, Workload(32, 512, 100))
    base = het(problem)[0]
    e1, e4 = problem.evaluate(replace(base, kappa=1)), problem.evaluate(replace(base, kappa=4))
    assert all(b <= a for a, b in zip(e1.stage_memory_bytes, e4.stage_memory_bytes, strict=True))
    assert e4.stage_memory_bytes[0] - e1.stage_memory_bytes[0] == (
        problem.memory.activation_bytes(base.v_prefill, base.v_decode, False, 4)
        - problem.memory.activation_bytes(base.v_prefill, base.v_decode, False, 1)
    )


def test_kappa_never_makes_modelled_prefill_slower():
    problem = build_problem(load_cluster("3xT4+V100"), load_shape("opt-30b"), Workload(32, 512, 100))
    ks = prefill_chunk_candidates(problem)
    assert ks == [1, 2, 4, 8]
    base = het(problem)[0]
    a, e = best_kappa(problem, base, ks)
    e1 = problem.evaluate(replace(base, kappa=1))
    assert e.fits and e.prefill_s <= e1.prefill_s * (1 + 1e-12) and e.objective <= e1.objective
    # the searched plan keeps the best kappa for its layout, and the plan file records it
    r = plan(problem, "transfer", time_limit_s=2, starts=[base])
    flat = problem.evaluate(replace(r.assignment, kappa=1))
    assert r.evaluation.prefill_s <= flat.prefill_s * (1 + 1e-12)
    from planner.build import make_plan

    pl = make_plan(problem, r.assignment, r.evaluation, "transfer", r.solve_seconds)
    assert pl.extra["prefill_chunks"] == r.assignment.kappa
    assert pl.extra["prefill_chunk_tokens"] == -(-512 // r.assignment.kappa)
    with pytest.raises(ValueError, match="kappa"):
        replace(base, kappa=0)


def test_exact_search_with_kappa_never_worse():
    """Exhaustive ILP over every kappa: allowing chunks can only lower the optimum, and helps here."""
    from test_planner_ilp import small_cluster, small_shape

    problem = build_problem(
        small_cluster([("T4", 9.0), ("V100", 7.0), ("V100", 7.0)]),
        small_shape(6),
        Workload(32, 512, 100, bits=(4, 16), theta=0.5),
    )
    kw = dict(group_size=1, exhaustive=True, micro_batches=[(8, 11)], time_limit_s=20)
    flat = plan(problem, "ilp", kappas=[1], **kw)
    chunked = plan(problem, "ilp", kappas=[1, 2, 4], **kw)
    assert chunked.evaluation.objective <= flat.evaluation.objective * (1 + 1e-9)
    assert chunked.evaluation.prefill_s < flat.evaluation.prefill_s
    assert chunked.assignment.kappa > 1


def test_pipeline_bound_is_below_every_plan():
    """The compare's bound is a lower bound: no baseline or searched plan is faster than it."""
    from planner.baselines import uniform
    from planner.bound import pipeline_latency_bound
    from planner.search import micro_batch_candidates

    problem = build_problem(load_cluster("3xT4+V100"), load_shape("opt-30b"), Workload(32, 512, 100))
    fitting = [x for x in (uniform(problem), het(problem)) if x]
    cap = min(e.omega for _, e in fitting)
    mbs = sorted({p for S in range(1, 5) for p in micro_batch_candidates(problem, S)})
    lb = pipeline_latency_bound(problem, cap, mbs, prefill_chunk_candidates(problem))
    r = plan(problem, "ilp", time_limit_s=2, omega_budget=cap, starts=[a for a, _ in fitting])
    assert 0 < lb <= r.evaluation.latency_s
    assert all(lb <= e.latency_s for _, e in fitting)
    assert pipeline_latency_bound(problem, None, mbs, [1]) <= lb  # no cap: more bit widths allowed


def test_profiler_clock_and_rounds():
    assert default_clock("cpu", 1) == "thread"
    assert default_clock("cpu", 4) == "wall" and default_clock("cuda", None) == "wall"
    shape = load_shape("llama:nano")
    grid = [(1, 16), (2, 32)]
    prof = profile_local(shape, "cpu", 1, grid, grid, reps=2, progress=False, min_time_s=0.0)
    assert prof.meta["clock"] == "thread" and prof.meta["reps"] == 2
    assert all(t > 0 for ph in ("prefill", "decode") for *_, t in prof.samples[16][ph])
    with pytest.raises(ValueError, match="thread clock"):
        profile_local(shape, "cpu", 2, grid, grid, reps=1, progress=False, clock="thread")
