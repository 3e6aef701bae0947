"""The README's main job, small: `fleetbatch loadgen demo` runs `fleetbatch gateway up` (embedded Redis, the planned default
fleet's 3 engines with their pipeline stages, gateway), submits a batch of real prompts, prints each
cluster's layout and the per-cluster summary, and stops everything."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from load.cli import build_parser, demo_dataset
from localmodels.paths import CACHE_ENV
from tests.harness import REPO


def test_loadgen_demo_runs_the_local_deployment_end_to_end(tmp_path):
    """On a fresh machine: an empty cache directory, so the tokenizer is trained and this CPU profiled during
    the run (`fleetbatch engine profile` run by `fleetbatch gateway up`, itself started by loadgen: it once ended itself, exit -15)."""
    # short answers: one long answer left alone on the slow cluster would set the test's time
    cmd = [sys.executable, "-m", "load.cli", "demo", "-n", "24", "--max-tokens", "32", "--no-progress",
           "--run-dir", str(tmp_path / "run")]  # fmt: skip
    cache = tmp_path / "empty-cache"
    env = {**os.environ, CACHE_ENV: str(cache)}
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["status"] == "completed" and summary["completed"] == 24 and summary["duplicates"] == 0
    assert set(summary["clusters"]) <= {"fast", "medium", "slow"} and len(summary["clusters"]) >= 2
    assert "cluster" in out.stdout and "output tok" in out.stdout  # the per-cluster table
    assert "predicted out" in out.stdout  # predicted against actual tokens per cluster
    assert all(c["predicted_completion_tokens"] > 0 for c in summary["clusters"].values())
    assert "length predictor: learned" in out.stdout + out.stderr  # the shipped model, not the heuristic
    assert "workload: mixed (real prompts, recorded lengths)" in out.stdout  # the data directory is here
    assert not (tmp_path / "run" / "gateway.json").exists(), "fleetbatch gateway up did not clean up"
    # the default fleet is planned: every cluster's layout is shown, then its plan against measurement
    assert (
        "planned layout per cluster:" in out.stdout and "plan against measurement per cluster:" in out.stdout
    )
    plans = summary["plans"]
    assert set(plans) == {"fast", "medium", "slow"}
    for p in plans.values():
        assert len(p["devices"]) == len(p["layers"]) == len(p["bits"]) >= 1
        assert p["layers"][0][0] == 0 and p["layers"][-1][1] == 8  # every layer of the 8-layer model
        assert p["predicted_tokens_per_s"] > 0
    assert any(p["measured_tokens_per_s"] for p in plans.values())
    engine_logs = "".join(f.read_text() for f in (tmp_path / "run" / "logs").glob("engine-*.log"))
    assert "emulated by its cost model" in engine_logs or "emulated devices" in engine_logs
    assert list((cache / "profiles").glob("*.json")), "the run profiled this CPU into the empty cache"


def test_the_demo_draws_real_prompts_where_the_data_is_and_generates_elsewhere(tmp_path, monkeypatch):
    args = build_parser().parse_args(["demo"])
    assert demo_dataset(args) == "mixed"  # ../shared/data is beside the repo here
    assert demo_dataset(build_parser().parse_args(["demo", "--dataset", "gsm8k"])) == "gsm8k"
    monkeypatch.setenv("FLEETBATCH_DATA", str(tmp_path / "nowhere"))
    assert demo_dataset(args) is None  # no data directory: the generated mix
