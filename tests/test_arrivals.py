"""Arrival processes (load/arrivals.py) and a real study that submits queries as they arrive."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from load.arrivals import arrivals, azure_arrivals, groups, poisson_arrivals
from load.workload import generated
from tests.harness import REPO


def test_azure_arrivals_replay_the_trace_gaps_scaled():
    a = azure_arrivals(200, "conv", seed=4)
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:], strict=False)) and a[-1] > 0
    assert azure_arrivals(200, "conv", scale=0.5, seed=4) == pytest.approx([t / 2 for t in a])
    assert azure_arrivals(200, "conv", seed=5) != a  # another start row
    assert arrivals("azure", 200, trace="conv", seed=4) == a
    assert azure_arrivals(30, "code")[-1] > 0


def test_other_processes_and_bad_arguments():
    assert arrivals("all", 3) == [0.0, 0.0, 0.0]
    assert arrivals("poisson", 0) == [] == arrivals("azure", 0)
    p = poisson_arrivals(500, 10.0, seed=1)
    assert p[0] == 0.0 and 30 < p[-1] < 80  # mean gap 0.1 s
    with pytest.raises(ValueError, match="arrivals must be one of"):
        arrivals("bursty", 3)
    with pytest.raises(ValueError, match="scale must be > 0"):
        azure_arrivals(3, scale=0)
    with pytest.raises(ValueError, match="trace has"):
        azure_arrivals(10**7)


def test_groups_cover_every_query_once_in_time_order():
    times = [0.0, 0.1, 0.3, 0.31, 2.0, 0.05]
    g = groups(times, 0.25)
    assert [idx for _, idx in g] == [[0, 1, 5], [2, 3], [4]]
    assert [at for at, _ in g] == [0.0, 0.3, 2.0]


@pytest.mark.slow
def test_a_study_with_azure_arrivals_submits_each_group_as_it_arrives(tmp_path):
    out = tmp_path / "study"
    cmd = [sys.executable, "-m", "load.cli", "study", "-n", "12", "--max-tokens", "16", "--dataset", "",
           "--only", "token_iteration_equal", "--out", str(out), "--no-progress", "--no-scale",
           "--arrivals", "azure", "--arrival-scale", "0.2", "--seed", "2"]  # fmt: skip
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    times = azure_arrivals(12, "conv", scale=0.2, seed=2)
    assert summary["arrivals"] == "azure" and summary["arrival_span_s"] == pytest.approx(max(times), abs=1e-3)
    assert summary["sim_makespan_error"] is None  # all-at-once runs only
    d = out / "r0" / "token_iteration_equal"
    meta = json.loads((d / "meta.json").read_text())
    expected = groups(times, 0.25)
    assert len(meta["batch_ids"]) == len(expected) > 1
    items = generated(12, 2, 16, True)  # the study's workload: --dataset '' is the generated mix
    group_of = {
        items[i].id: f"study-token_iteration_equal-{k}" for k, (_, idx) in enumerate(expected) for i in idx
    }
    rows = [json.loads(line) for line in (d / "results.jsonl").read_text().splitlines()]
    assert sorted(r["query_id"] for r in rows) == sorted(group_of)
    assert all(r["batch_id"] == group_of[r["query_id"]] for r in rows)
    report = json.loads((d / "report.json").read_text())
    assert report["queries"] == 12 and report["latency_s"]["p90"] > 0
