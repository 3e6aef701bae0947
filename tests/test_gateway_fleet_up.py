"""`fleetbatch gateway up --fleet`: planned clusters become engines that run their plans (issue 32).

The whole path (profile, plan, engines, a batch) runs in `tests/test_demo.py`; here the pieces,
and a bad fleet refused before anything starts.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from gateway.deploy.fleet_up import FleetSettings, bits_histogram, chosen, describe_layout, fleet_specs
from tests.harness import REPO


def row(method: str, tps: float, devices=("T4", "T4"), bits=((4, 4, 8), (8, 8))) -> dict:
    layers, start = [], 0
    for b in bits:
        layers.append([start, start + len(b)])
        start += len(b)
    return {"plan": f"/plans/x.{method}.json", "method": method, "devices": list(devices), "layers": layers,
            "bits": [list(b) for b in bits], "prefill_micro_batch": 2, "decode_micro_batch": 8,
            "predicted_tokens_per_s": tps, "solve_seconds": 0.1}  # fmt: skip


SUMMARY = {
    "fleet": {"clusters": {"x": ["T4", "T4", "V100-32G"]}},
    "clusters": {"x": {"ilp": row("ilp", 50.0), "uniform": row("uniform", 30.0), "het": row("het", 35.0)}},
}


def test_each_cluster_runs_its_plan_on_emulated_devices_with_the_plans_capacity():
    specs, layouts = fleet_specs(FleetSettings(kv_tokens=4096), SUMMARY)
    (spec,) = specs
    assert spec.name == "x" and spec.plan == "/plans/x.ilp.json" and spec.capacity_tps == 50.0
    args = spec.engine_args
    assert args[args.index("--device-cost") + 1] == "plan"
    assert args[args.index("--kv-budget-tokens") + 1] == "4096" and args[args.index("--size") + 1] == "micro"
    assert layouts["x"]["method"] == "ilp"


def test_a_cluster_name_the_queue_cannot_hold_is_refused():
    bad = {**SUMMARY, "clusters": {"a b": SUMMARY["clusters"]["x"]}}
    with pytest.raises(ValueError, match="name"):
        fleet_specs(FleetSettings(), bad)


def test_the_best_baseline_is_the_faster_baseline_by_the_model():
    assert chosen(SUMMARY["clusters"]["x"], "best-baseline")["method"] == "het"
    assert chosen(SUMMARY["clusters"]["x"], "uniform")["method"] == "uniform"
    specs, _ = fleet_specs(FleetSettings(method="best-baseline"), SUMMARY)
    assert specs[0].plan == "/plans/x.het.json" and specs[0].capacity_tps == 35.0


def test_the_layout_line_names_devices_layers_bits_and_idle_devices():
    r = SUMMARY["clusters"]["x"]["ilp"]
    assert bits_histogram(r) == "4-bit x2, 8-bit x3"
    line = describe_layout("x", r, SUMMARY["fleet"]["clusters"]["x"])
    assert "2 stage(s): T4 layers 0-2; T4 layers 3-4 (V100-32G left idle)" in line
    assert "predicts 50 tokens/s" in line


def up_args(**kw) -> argparse.Namespace:
    base = {"clusters": "default", "fleet_method": "ilp", "fleet_lengths": "100,80", "size": None}
    return argparse.Namespace(**{**base, **kw})


def test_settings_come_from_the_command_line_and_bad_lengths_are_named():
    s = FleetSettings.from_args(up_args())
    assert (s.prompt_len, s.output_tokens, s.size, s.method) == (100, 80, "micro", "ilp")
    for bad in ("x", "100", "0,10", "10,-1"):
        with pytest.raises(ValueError, match="--fleet-lengths"):
            FleetSettings.from_args(up_args(fleet_lengths=bad))


def test_a_bad_fleet_file_stops_gateway_up_before_anything_starts(tmp_path):
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text("version: 1\nclusters:\n  - {name: a, devices: [H9000]}\n")
    run = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "up", "--clusters", str(fleet), "--run-dir", str(run)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode != 0
    assert "unknown device type 'H9000'" in out.stderr and "fleetbatch planner fleet" in out.stderr
    assert not (run / "redis").exists() and not (run / "gateway.json").exists()  # nothing was started


def test_the_quick_fleet_serves_the_served_model_when_one_is_given():
    from gateway.deploy.up import default_clusters

    random = default_clusters(2, "native", "nano")
    assert [c.engine_args[:2] for c in random] == [["--size", "nano"]] * 2
    served = default_clusters(2, "native", "nano", "/models/m")
    assert all(
        c.engine_args[:2] == ["--served-model", "/models/m"] and "--size" not in c.engine_args for c in served
    )
