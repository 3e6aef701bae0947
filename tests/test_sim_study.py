"""The simulator's assignment is the real policy's; the study and scale commands print their JSON."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(
    0, str(Path(__file__).resolve().parent.parent)
)  # `sim` is not in pyproject's package list yet

from engines.scheduler import Scheduler  # noqa: E402
from gateway.assign.policies import ClusterView, QueryLoad  # noqa: E402
from gateway.assign.registry import make_policy
from load.arrivals import poisson_arrivals  # noqa: E402
from sim.cli import main  # noqa: E402
from sim.core import ClusterSpec, SimConfig, Simulator  # noqa: E402
from sim.costs import LinearCost  # noqa: E402
from sim.study import StudySetup, scale  # noqa: E402
from sim.validate import held_out  # noqa: E402
from sim.workload import Workload, generated_workload  # noqa: E402


def small_workload(n: int = 400, seed: int = 3) -> Workload:
    rng = random.Random(seed)
    true = [max(1, int(rng.lognormvariate(3.5, 1.0))) for _ in range(n)]
    pred = [t * rng.uniform(0.5, 1.5) for t in true]
    return Workload([rng.randint(5, 300) for _ in range(n)], [min(t, 256) for t in true], pred, [0.0] * n)


@pytest.mark.parametrize("policy", ["round_robin", "token"])
def test_assignment_is_what_the_real_policy_returns(policy):
    w = small_workload()
    specs = [ClusterSpec(f"c{i}", LinearCost(speed=s), "iteration", 6) for i, s in enumerate((1, 2, 4))]
    sim = Simulator(specs, w, SimConfig(policy=policy, offload=False))
    sim.run()
    loads = [QueryLoad(str(q), w.prompt_tokens[q], w.predicted_tokens[q]) for q in range(len(w))]
    views = [ClusterView(c.name, c.capacity) for c in sim.clusters]
    expected = make_policy(policy).assign(loads, views)
    got = [sim.clusters[i].name for i in sim.assigned]
    assert got == expected
    per = {c.name: c.finished for c in sim.clusters}
    assert per == {n: expected.count(n) for n in per}  # no offloading: each query ran where it was assigned
    if policy == "token":  # capacity-weighted: the fast cluster got the most predicted tokens
        tokens = {n: 0.0 for n in per}
        for q, n in zip(loads, expected, strict=True):
            tokens[n] += q.total_tokens
        assert tokens["c0"] < tokens["c1"] < tokens["c2"]


def test_offloading_moves_work_to_idle_clusters_and_every_query_finishes_once():
    w = small_workload(600)
    specs = [ClusterSpec(f"c{i}", LinearCost(speed=s), "iteration", 4) for i, s in enumerate((1, 2, 4))]
    off = Simulator(specs, w, SimConfig(policy="round_robin", offload=False)).run()
    on = Simulator(specs, w, SimConfig(policy="round_robin", offload=True)).run()
    assert on.moved > 0 and off.moved == 0
    assert sum(c["moved_in"] for c in on.per_cluster.values()) == on.moved
    assert on.per_cluster["c2"]["moved_in"] > 0  # the fastest cluster runs dry first and takes work
    assert on.makespan_s < off.makespan_s
    assert on.generated_tokens == off.generated_tokens == sum(w.true_tokens)
    assert all(t > 0 for t in on.finish_s)


def test_poisson_arrivals_finish_after_they_arrive():
    w = generated_workload(300, seed=2)
    w = w.with_arrivals(poisson_arrivals(len(w), 5.0, seed=2))
    specs = [ClusterSpec(f"c{i}", LinearCost(), "iteration", 8) for i in range(3)]
    r = Simulator(specs, w, SimConfig(policy="token")).run()
    assert all(f > a for f, a in zip(r.finish_s, w.arrival_s, strict=True))
    assert r.makespan_s >= w.arrival_s[-1] - w.arrival_s[0]


def test_static_batches_hold_kv_longer_than_iteration_level():
    w = small_workload(300)
    out = {}
    for backend in ("static", "iteration"):
        specs = [ClusterSpec(f"c{i}", LinearCost(), backend, 8) for i in range(3)]
        out[backend] = Simulator(specs, w, SimConfig(policy="token", offload=False)).run()
    assert out["iteration"].kv_token_seconds < out["static"].kv_token_seconds
    assert out["iteration"].makespan_s < out["static"].makespan_s


def test_study_cli_prints_the_ratios_as_its_last_line(capsys):
    rc = main(
        "study --workload generated --num-queries 60,120 --batches 2,8 --cluster-counts 3,6 --no-progress".split()
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("qi_over_rr_static", "qi_over_rr_iteration_unequal", "kv_ratio_iteration_vs_static"):
        assert out[key] > 0
    assert set(out["clusters"]) == {"3", "6"}
    assert len(out["grid"]) == 4
    assert out["makespan_s[token+iteration]"] > 0
    assert out["kv_token_seconds[round_robin+static]"] > out["kv_token_seconds[token+iteration]"]


def test_scale_cli_reports_its_time(capsys):
    assert main("scale --num-clusters 4 --num-queries 3000 --no-progress".split()) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["queries"] == 3000 and out["clusters"] == 4
    assert out["sim_seconds"] > 0 and out["makespan_s"] > 0
    assert "sim_seconds_100x1m" not in out  # only measured at that size


def test_scale_run_calls_the_scheduler_about_once_per_query(monkeypatch):
    """The scale check's cost (sim_seconds_100x1m) rests on bulk decode: the real scheduler plans a
    step about once per query (its admission), and the ~9 steady decode steps in between are applied
    at once. Counted, not timed: with one schedule() per step it would be ~10 per query."""
    calls = 0
    real = Scheduler.schedule

    def counted(self, *args, **kwargs):
        nonlocal calls
        calls += 1
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Scheduler, "schedule", counted)
    out = scale(4, 3000, 8, StudySetup())
    assert calls <= 1.1 * 3000  # 3,135 at the time of writing
    assert out["steps"] >= 8 * calls  # 28,955 steps


def test_cli_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        main(["study", "--batches", "0"])
    assert main("scale --speeds 1,-2 --no-progress".split()) == 1
    assert "speeds" in capsys.readouterr().err


def test_cost_from_a_planner_profile(tmp_path):
    from planner.catalog import device_type
    from planner.latency import roofline_profile
    from planner.modelshape import load_shape

    shape = load_shape("llama:small")
    costs = {}
    for dev in ("T4", "A100"):
        path = tmp_path / f"{dev}.json"
        roofline_profile(device_type(dev), shape, [16]).save(path)
        costs[dev] = LinearCost.from_profile(path, layers=8)
    t4, a100 = costs["T4"], costs["A100"]
    assert t4.step_s(256, 8) > a100.step_s(256, 8) > 0  # the slower GPU takes longer per step
    assert t4.step_s(0, 16) > t4.step_s(0, 8) > t4.step_s(0, 0)
    with pytest.raises(ValueError, match="bits"):
        LinearCost.from_profile(tmp_path / "T4.json", layers=8, bits=4)


def test_a_query_larger_than_the_kv_cache_fails_alone():
    w = Workload([10, 5000, 12, 8], [5, 5, 7, 3], [5.0, 5.0, 7.0, 3.0], [0.0] * 4)
    spec = ClusterSpec("c0", LinearCost(), "iteration", 4, kv_budget_tokens=1024)
    r = Simulator([spec], w, SimConfig(policy="round_robin", offload=False)).run()
    assert r.per_cluster["c0"]["failed"] == 1 and r.per_cluster["c0"]["queries"] == 4
    assert r.generated_tokens == 5 + 7 + 3


def test_mixed_workload_has_real_lengths_and_a_fitted_prediction(data_root, monkeypatch):
    from sim.workload import mixed_workload

    monkeypatch.setenv("FLEETBATCH_DATA", str(data_root))
    w = mixed_workload(60, seed=0, max_tokens=256, tokenizer=None, train_max=500)  # lengths in words here
    assert len(w) == 60 and w.source == "mixed"
    assert 1 <= min(w.true_tokens) and max(w.true_tokens) <= 256
    assert len(set(w.true_tokens)) > 20  # recorded lengths, not a formula
    assert all(1.0 <= p <= 256 for p in w.predicted_tokens)
    r = Simulator(
        [ClusterSpec(f"c{i}", LinearCost(), "iteration", 4) for i in range(3)], w, SimConfig(policy="token")
    ).run()
    assert r.generated_tokens == sum(w.true_tokens)


def test_the_held_out_scale_comes_from_the_runs_of_the_same_session():
    # two sessions: the machine ran 1.5x slower in the first; the model is right up to that speed
    simulated = [10.0, 20.0, 30.0, 10.0, 20.0, 30.0]
    real = [15.0, 30.0, 45.0, 10.0, 20.0, 30.0]
    sessions = ["r0", "r0", "r0", "r1", "r1", "r1"]
    assert held_out(real, simulated, sessions) == pytest.approx(real)  # exact within each session
    pooled = held_out(real, simulated, [""] * 6)  # one scale for both sessions is off in each
    assert all(abs(p - m) / m > 0.15 for p, m in zip(pooled, real, strict=True))
    assert held_out([12.0, 30.0], [10.0, 20.0], ["a", "b"]) == pytest.approx(
        [15.0, 24.0]
    )  # alone: all others
