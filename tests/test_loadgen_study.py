"""`fleetbatch loadgen study` on a real (tiny) deployment writes run directories that `fleetbatch loadgen report` reads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from load.studies.study import sim_ratios
from sim.costs import LinearCost
from sim.validate import validate
from tests.harness import REPO

pytestmark = pytest.mark.slow


def test_a_tiny_study_writes_reports_with_plots_from_real_runs(tmp_path, capsys):
    out = tmp_path / "study"
    cmd = [sys.executable, "-m", "load.cli", "study", "-n", "16", "--max-tokens", "24", "--dataset", "",
           "--only", "token_static_equal,token_iteration_equal", "--out", str(out), "--no-progress",
           "--no-scale"]  # fmt: skip
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert summary["kv_ratio_iteration_vs_static"] > 0
    assert (
        "sim_makespan_error" in summary and summary["sim_seconds_100x1m"] is None
    )  # one iteration run; --no-scale
    assert set(summary["runs"]) == {"token_static_equal", "token_iteration_equal"}
    for name in summary["runs"]:
        d = out / "r0" / name
        report = json.loads((d / "report.json").read_text())
        assert report["queries"] == 16 and sum(c["queries"] for c in report["clusters"].values()) == 16
        assert report["cumulative_kv_token_s"] > 0 and report["makespan_s"] > 0
        assert all((d / f).stat().st_size > 5000 for f in ("kv.png", "finished.png", "cdf.png"))
        # the engines emulated the default cost-model device and said how often their compute outlasted it
        assert 0 <= report["device_overrun_fraction"] <= 1
    from load.cli import main as loadgen_main  # `fleetbatch loadgen report` reads the run directory back

    assert loadgen_main(["report", str(out / "r0" / "token_static_equal"), "--no-plots"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["queries"] == 16
    check = validate(
        [out / "r0" / name for name in summary["runs"]], LinearCost()
    )  # the simulator replays them
    assert len(check["runs"]) == 2 and 0 <= check["sim_makespan_error"] < 10
    assert check["fitted"] is False  # replayed on the runs' own device (meta.json), no scale fitted
    assert summary["emulation"] == "cost" and summary["step_cost_ms"] == "15,0.2,1"
    assert all(r["real_makespan_s"] == pytest.approx(summary["runs"][Path(r["run"]).name]["makespan_s"], abs=0.01)
               for r in check["runs"])  # fmt: skip


def test_the_planned_study_runs_a_planned_fleet_through_the_gateway(tmp_path):
    """`fleetbatch loadgen study --planned`: each setup is a real `fleetbatch gateway up --clusters` whose engines run
    their plans' stages on emulated devices; the run directory keeps the plans and draws the layout. (One
    setup here, for time: the baselines' plans are checked in tests/test_planner_fleet.py.) The run reads
    this CPU's profile from the cache `gateway prepare` filled; tests/test_demo.py starts `gateway up` from a
    wholly empty cache, where the run profiles this CPU (the step a fresh machine once failed)."""
    out = tmp_path / "planned"
    fleet = tmp_path / "fleet.yaml"  # one cluster of unlike devices, two stages (the demo runs three)
    fleet.write_text("version: 1\nclusters:\n  - {name: pair, devices: [V100-32G, T4]}\n")
    # the predictor is not under test: the heuristic starts faster
    cmd = [sys.executable, "-m", "load.cli", "study", "--planned", "--clusters", str(fleet), "-n", "16",
           "--max-tokens", "24", "--only", "planned", "--out", str(out), "--no-progress", "--no-scale",
           "--gateway-arg=--predictor", "--gateway-arg=heuristic"]  # fmt: skip
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert "planned_over_even" not in summary  # its baseline did not run
    assert summary["capacity_error"] is not None and summary["capacity_error"] >= 0
    assert 0 <= summary["device_overrun_fraction"] <= 1
    assert "sim_makespan_error" in summary and summary["sim_seconds_100x1m"] is None
    report = json.loads((out / "planned" / "report.json").read_text())
    assert report["queries"] == 16 and set(report["plans"]) == {"pair"}
    assert all(p["predicted_tokens_per_s"] > 0 for p in report["plans"].values())
    assert (out / "planned" / "layout.png").stat().st_size > 5000
    meta = json.loads((out / "planned" / "meta.json").read_text())
    assert meta["planned"]["method"] == "ilp"
    assert all((out / "planned" / c["plan"]).is_file() for c in meta["planned"]["clusters"].values())


def test_the_simulators_ratios_sit_beside_the_measured_ones():
    rows = [
        {"run": f"/x/{rep}/{name}", "sim_makespan_s": m}
        for rep, ms in (("r0", (60.0, 24.0, 30.0)), ("r1", (59.0, 23.6, 31.0)))
        for name, m in zip(
            ("rr_static_equal", "token_iteration_equal", "token_static_equal"), ms, strict=True
        )
    ]
    out = sim_ratios(rows, {"qi_over_rr_static": 2.45})
    assert out["sim_qi_over_rr_static"] == pytest.approx(2.5, abs=1e-3)  # median of 2.5 and 2.5
    assert out["qi_over_rr_static_vs_sim"] == pytest.approx(0.98, abs=1e-3)
    assert "sim_kv_ratio_iteration_vs_static" not in out  # a KV ratio is not a makespan ratio
