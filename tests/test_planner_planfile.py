"""plan.json: round trip, validation, single-CPU plans, the CLI."""

from __future__ import annotations

import json

import pytest

from planfile import PlanError, load_plan, save_plan
from planner.build import make_plan
from planner.cli import main
from planner.cluster import load_cluster
from planner.costs import Workload
from planner.modelshape import load_shape
from planner.problem import build_problem
from planner.search import plan


def _cpu_plan():
    problem = build_problem(load_cluster("1xCPU"), load_shape("llama:tiny"), Workload(4, 32, 8, theta=1.0))
    r = plan(problem, "ilp", time_limit_s=2)
    return make_plan(problem, r.assignment, r.evaluation, "ilp", r.solve_seconds)


def test_plan_roundtrip_and_accessors(tmp_path):
    p = _cpu_plan()
    assert len(p.stages) == 1 and p.devices[0]["type"] == "CPU"
    path = tmp_path / "plan.json"
    save_plan(p, path)
    q = load_plan(path)
    assert q.to_dict() == p.to_dict()
    assert q.layer_bits() == p.stages[0].bits and len(q.layer_bits()) == 4
    assert q.stage_of_layer(3) == 0
    with pytest.raises(IndexError):
        q.stage_of_layer(4)
    assert q.predicted_throughput_tokens_per_s > 0


def test_multi_stage_plan_layers(tmp_path):
    problem = build_problem(load_cluster("3xT4+V100"), load_shape("opt-30b"), Workload(32, 512, 100))
    r = plan(problem, "transfer")
    p = make_plan(problem, r.assignment, r.evaluation, "transfer", r.solve_seconds)
    save_plan(p, tmp_path / "p.json")
    q = load_plan(tmp_path / "p.json")
    assert [q.stage_of_layer(i) for i in range(48)] == sorted(q.stage_of_layer(i) for i in range(48))
    assert q.stage_of_layer(47) == len(q.stages) - 1


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.update(version=2), "version"),
        (lambda d: d["stages"][0].update(layer_end=3, bits=d["stages"][0]["bits"][:3]), "cover"),
        (lambda d: d["stages"][0].update(bits=[5, 5, 5, 5]), "bits"),
        (lambda d: d.pop("kv_bits"), "kv_bits"),
        (lambda d: d["stages"][0].update(device_index=9), "device_index"),
        (lambda d: d["model"].pop("vocab"), "vocab"),
    ],
)
def test_invalid_plans_are_rejected(tmp_path, mutate, message):
    d = _cpu_plan().to_dict()
    mutate(d)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    with pytest.raises(PlanError, match=message):
        load_plan(path)


def test_cli_plan_writes_valid_plan(tmp_path, capsys):
    out = tmp_path / "plan.json"
    rc = main(
        ["plan", "--cluster-spec", "V100+A100", "--shape", "opt-13b", "--output-tokens", "100", "--out", str(out)]
    )
    assert rc == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    summary = json.loads(last)
    assert summary["predicted_throughput_tokens_per_s"] > 0
    assert load_plan(out).model["layers"] == 40


def test_cli_bad_input_exits_nonzero_with_message(tmp_path, capsys):
    assert (
        main(
            [
                "plan",
                "--cluster-spec",
                "2xZ80",
                "--shape",
                "opt-13b",
                "--output-tokens",
                "10",
                "--out",
                str(tmp_path / "x"),
            ]
        )
        == 1
    )
    assert "unknown device type" in capsys.readouterr().err
    assert (
        main(
            [
                "plan",
                "--cluster-spec",
                "1xT4",
                "--shape",
                "opt-66b",
                "--output-tokens",
                "100",
                "--out",
                str(tmp_path / "x"),
            ]
        )
        == 1
    )
    assert "no plan fits" in capsys.readouterr().err
    assert main(["plan", "--cluster-spec", "1xT4", "--shape", "nope", "--output-tokens", "10"]) == 1
    assert "unknown model" in capsys.readouterr().err


def test_cli_length_distribution(tmp_path, capsys):
    dist = tmp_path / "len.json"
    dist.write_text(json.dumps({"buckets": [[0, 100, 0.5], [100, 300, 0.5]]}))
    out = tmp_path / "plan.json"
    assert (
        main(
            [
                "plan",
                "--cluster-spec",
                "4xA100",
                "--shape",
                "opt-13b",
                "--length-distribution",
                str(dist),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert load_plan(out).expected_output_tokens == 125


def test_cli_compare_last_line_json(capsys):
    assert (
        main(
            [
                "compare",
                "--cluster-specs",
                "V100+A100",
                "--shapes",
                "opt-13b",
                "--no-progress",
                "--time-limit",
                "2",
            ]
        )
        == 0
    )
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for k in (
        "pairs",
        "pairs_with_fitting_baseline",
        "mean_speedup_vs_best_baseline",
        "max_speedup_vs_best_baseline",
        "min_speedup_vs_best_baseline",
        "mean_speedup_upper_bound",
        "max_solve_seconds",
        "mean_solve_seconds",
        "mean_speedup_upper_bound_tp",
        "pairs_using_tp",
        "tp_sizes",
    ):
        assert k in summary
    assert summary["mean_speedup_vs_best_baseline"] >= 1.0


def test_cli_plan_writes_into_a_folder_it_makes_and_names_one_it_cannot(tmp_path, capsys):
    """`--out plans/a.json` in a checkout without `plans/` (the how-to's command): the folder is made, not a
    traceback after the solve; a folder that cannot be made is named before solving."""
    argv = ["plan", "--cluster-spec", "1xA100-40G", "--shape", "llama:tiny", "--output-tokens", "32", "--out"]
    out = tmp_path / "plans" / "deeper" / "a.json"
    assert main([*argv, str(out)]) == 0
    assert json.loads(out.read_text())["stages"]
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    assert main([*argv, str(blocker / "a.json")]) == 1
    err = capsys.readouterr().err
    assert "--out" in err and str(blocker) in err and "Traceback" not in err
    bad_spec = ["plan", "--cluster-spec", "9xNoSuchGPU", "--shape", "llama:tiny", "--output-tokens", "32"]
    assert main([*bad_spec, "--out", str(tmp_path / "never" / "a.json")]) == 1
    assert not (tmp_path / "never").exists()  # a bad input makes no folder
