"""Tensor parallelism inside a node: cost model, memory, exact search with TP groups, plan file field."""

from __future__ import annotations

import itertools
import json
import math

import pytest
from transformers import OPTConfig

from planfile import PlanError, load_plan, save_plan
from planner.build import make_plan
from planner.cluster import cluster_from_dict, load_cluster
from planner.costs import Assignment, Problem, Workload
from planner.modelshape import ModelShape
from planner.problem import build_problem
from planner.search import device_orders, plan, tp_groupings
from tests.test_planner_ilp import small_shape


def test_tp_never_slower_when_allreduce_is_free(monkeypatch):
    monkeypatch.setattr(Problem, "allreduce_s", lambda self, u, nbytes: 0.0)
    problem = build_problem(load_cluster("4xT4"), small_shape(4), Workload(32, 512, 100, bits=(4, 8, 16)))
    units = {t: problem.tp_unit(range(t)) for t in (2, 4)}
    for t, u in units.items():
        assert problem.unit_tp(u) == t
        for b in problem.bits:
            for v in (1, 4, 32):
                for kappa in (1, 4):
                    assert problem.layer_prefill_s(u, b, v, kappa) <= problem.layer_prefill_s(0, b, v, kappa)
                assert problem.layer_decode_s(u, b, v) <= problem.layer_decode_s(0, b, v)
        a1 = Assignment((0,), (4,), (16,) * 4, 8, 32)
        at = Assignment((u,), (4,), (16,) * 4, 8, 32)
        assert problem.evaluate(at).latency_s <= problem.evaluate(a1).latency_s
    # decode at B = 32 is memory-bound: TP-4 cuts the layer time by nearly 4x
    assert problem.layer_decode_s(units[4], 16, 32) < 0.3 * problem.layer_decode_s(0, 16, 32)


def test_allreduce_cost_counts():
    problem = build_problem(load_cluster("4xT4"), small_shape(4), Workload(32, 512, 100, bits=(16,)))
    u = problem.tp_unit((0, 1, 2, 3))
    nbytes = 32 * 5120 * 2
    bw = 128e9 / 8  # T4 node: PCIe 3 x16 default
    lat = problem.cluster.devices[0].type.allreduce_latency_s
    assert problem.allreduce_s(u, nbytes) == pytest.approx(2 * 3 / 4 * nbytes / bw + lat)
    assert problem.allreduce_s(0, nbytes) == 0.0
    # a V100 node defaults to NVLink (catalog), a spec value overrides it
    assert load_cluster("4xV100").bandwidth_bytes_per_s(0, 1) > 8 * load_cluster(
        "4xT4"
    ).bandwidth_bytes_per_s(0, 1)


def test_tp_memory_per_device_shrinks_by_t():
    problem = build_problem(load_cluster("4xV100"), small_shape(8), Workload(32, 512, 100, bits=(16,)))
    per = {}
    for t in (1, 2, 4):
        u = problem.tp_unit(tuple(range(t)))
        e = problem.evaluate(Assignment((u,), (8,), (16,) * 8, 8, 8))
        const = problem.stage_memory_constant(1, 0, 8, 8)
        per[t] = e.stage_memory_bytes[0] - const
        assert e.stage_capacity_bytes[0] == problem.capacity(0)
    layers = 8 * problem.layer_bytes(16)
    assert per[1] == layers
    for t in (2, 4):
        assert per[t] == math.ceil(layers / t)
        assert per[1] / per[t] == pytest.approx(t, rel=1e-6)


def test_tp_groups_follow_nodes_types_and_heads():
    # 3 T4 on one node, 1 V100 on another: T4 groups of 2 only; never across nodes or types
    problem = build_problem(load_cluster("3xT4+V100"), small_shape(4), Workload(32, 512, 100, bits=(16,)))
    groupings = tp_groupings(problem, (1, 2, 4))
    sizes = sorted(sorted(problem.unit_tp(u) for u in g) for g in groupings)
    assert sizes == [[1, 1, 1, 1], [1, 1, 2]]
    with pytest.raises(ValueError):
        problem.tp_unit((2, 3))  # T4 + V100
    # 40 heads split over 2 and 4, not over 3; a model with 6 heads allows 2 only
    assert problem.tp_allowed(4) and not problem.tp_allowed(3)
    cfg = OPTConfig(
        hidden_size=384, num_hidden_layers=2, ffn_dim=1536, num_attention_heads=6, word_embed_proj_dim=384
    )
    p6 = build_problem(load_cluster("4xT4"), ModelShape("h6", cfg), Workload(4, 64, 8, bits=(16,)))
    assert {p6.unit_tp(u) for g in tp_groupings(p6, (1, 2, 4)) for u in g} == {1, 2}
    # pipeline-only orders (the baselines') contain single devices only
    assert all(u < 4 for o in device_orders(problem) for u in o)
    # a unit may not appear with one of its own devices
    u = problem.tp_unit((0, 1))
    with pytest.raises(ValueError):
        problem.evaluate(Assignment((u, 0), (2, 2), (16,) * 4, 8, 8))


def brute_force_tp(problem: Problem, v_p: int, v_d: int) -> float:
    """Minimum objective over every ordered set of disjoint units (single devices and TP groups), split and bits."""
    n, L = len(problem.cluster.devices), problem.layers
    units = list(range(n))
    c = problem.cluster.devices
    for t in (2, 4):
        if not problem.tp_allowed(t):
            continue
        for g in itertools.combinations(range(n), t):
            if len({(c[i].node, c[i].type.name) for i in g}) == 1:
                units.append(problem.tp_unit(g))
    best = math.inf
    all_bits = list(itertools.product(problem.bits, repeat=L))
    for S in range(1, min(len(units), L) + 1):
        for order in itertools.permutations(units, S):
            phys = [d for u in order for d in problem.unit_devices(u)]
            if len(set(phys)) != len(phys):
                continue
            for cuts in itertools.combinations(range(1, L), S - 1):
                bounds = (0, *cuts, L)
                counts = tuple(bounds[i + 1] - bounds[i] for i in range(S))
                for bits in all_bits:
                    e = problem.evaluate(Assignment(order, counts, bits, v_p, v_d))
                    if e.fits and e.objective < best:
                        best = e.objective
    return best


def test_exact_search_with_tp_equals_brute_force():
    cluster = cluster_from_dict(
        {
            "name": "tiny",
            "nodes": [
                {"name": "t4s", "devices": [{"type": "T4", "count": 2, "memory_gib": 6.0}]},
                {"name": "v", "devices": [{"type": "V100", "memory_gib": 5.0}]},
            ],
        }
    )
    problem = build_problem(cluster, small_shape(4), Workload(32, 512, 100, bits=(4, 16), theta=0.3))
    expected = brute_force_tp(problem, 8, 16)
    assert math.isfinite(expected)
    r = plan(
        problem, "ilp", group_size=1, exhaustive=True, micro_batches=[(8, 16)], kappas=[1], tp_sizes=(1, 2)
    )
    assert r is not None and r.evaluation.fits
    assert r.evaluation.objective == pytest.approx(expected, rel=1e-6)
    # and TP pays here: the pipeline-only optimum is worse
    pp = plan(
        problem, "ilp", group_size=1, exhaustive=True, micro_batches=[(8, 16)], kappas=[1], tp_sizes=(1,)
    )
    assert pp is not None and pp.evaluation.objective > r.evaluation.objective
    assert any(problem.unit_tp(u) == 2 for u in r.assignment.order)


def _tp_plan():
    problem = build_problem(load_cluster("4xT4+2xV100"), small_shape(8), Workload(32, 512, 100, bits=(8, 16)))
    t4 = problem.tp_unit((0, 1, 2, 3))
    v = problem.tp_unit((4, 5))
    a = Assignment((t4, v), (3, 5), (16,) * 8, 8, 16)
    return problem, make_plan(problem, a, problem.evaluate(a), "ilp", 0.1)


def test_tp_plan_file_roundtrip(tmp_path):
    problem, p = _tp_plan()
    assert [s.tp_device_indices for s in p.stages] == [[0, 2, 3, 4], [1, 5]]
    assert [d["type"] for d in p.devices] == ["T4", "V100-32G", "T4", "T4", "T4", "V100-32G"]
    save_plan(p, tmp_path / "tp.json")
    q = load_plan(tmp_path / "tp.json")
    assert q.to_dict() == p.to_dict()
    assert q.stages[0].devices_of_stage == [0, 2, 3, 4] and q.extra["tensor_parallel"] == [4, 2]
    assert q.stage_of_layer(2) == 0 and q.stage_of_layer(3) == 1 and len(q.layer_bits()) == 8


def test_old_plan_files_still_load(tmp_path):
    problem = build_problem(load_cluster("3xT4+V100"), small_shape(8), Workload(32, 512, 100, bits=(16,)))
    a = Assignment((0, 3), (4, 4), (16,) * 8, 8, 8)
    d = make_plan(problem, a, problem.evaluate(a), "het", 0.1).to_dict()
    assert all("tp_device_indices" not in s for s in d["stages"])  # plans without TP are written as before
    (tmp_path / "old.json").write_text(json.dumps(d))
    q = load_plan(tmp_path / "old.json")
    assert [s.devices_of_stage for s in q.stages] == [[0], [1]]
    assert q.stage_of_layer(5) == 1


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d["stages"][0].update(tp_device_indices=[2, 0]), "start with"),
        (lambda d: d["stages"][0].update(tp_device_indices=[0, 9]), "out of range"),
        (lambda d: d["stages"][0].update(tp_device_indices=[0, 2, 3, 5]), "one type on one node"),
        (lambda d: d["stages"][1].update(device_index=2, tp_device_indices=None), "used twice"),
        (lambda d: d["stages"][0].update(tp_device_indices=[0, 2, 2, 3]), "used twice"),
        (lambda d: d["stages"][0].update(tp_device_indices=[0, 2, 3]), "heads"),
        (lambda d: d["stages"][0].update(tp_device_indices="0"), "non-empty list"),
    ],
)
def test_invalid_tp_fields_are_rejected(tmp_path, mutate, message):
    _, p = _tp_plan()
    d = p.to_dict()
    mutate(d)
    (tmp_path / "bad.json").write_text(json.dumps(d))
    with pytest.raises(PlanError, match=message):
        load_plan(tmp_path / "bad.json")
