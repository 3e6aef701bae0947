"""`fleetbatch loadgen wan`: the summary's figures from recorded run directories, the heartbeat figures it reads,
and one tiny real run through the CLI with every engine behind a latency proxy."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from load.cli import main
from load.reports.runrecord import META, RESULTS, TIMESERIES
from load.studies.wan_plot import PLOT, draw
from load.studies.wan_stats import COST_MODEL, HEARTBEAT, cluster_figures, rtt_key, summarise
from tests.harness import REPO
from workqueue import WorkQueue, connect

T0 = 1_000_000.0


def _write(d: Path, results: list[dict], series: list[dict], meta: dict) -> Path:
    d.mkdir(parents=True)
    (d / RESULTS).write_text("".join(json.dumps(r) + "\n" for r in results))
    (d / TIMESERIES).write_text("".join(json.dumps(r) + "\n" for r in series))
    (d / META).write_text(json.dumps(meta))
    return d


def _result(cluster: str, started: float, finished: float, prompt: int = 10, done: int = 5) -> dict:
    timings = {"enqueued_at": T0, "started_at": T0 + started, "finished_at": T0 + finished}
    return {"cluster": cluster, "timings": timings, "prompt_tokens": prompt, "completion_tokens": done}


def _sample(cluster: str, t: float, **figures) -> dict:
    return {
        "t": T0 + t,
        "hb_t": T0 + t,
        "cluster": cluster,
        "device_steps": figures.pop("device_steps", 0),
        **figures,
    }


def _run(tmp: Path, name: str, finish: float, busy: float, trips: int, steps: int) -> Path:
    """Two clusters: a claims at 1 s and finishes at ``finish``; b at 1 s and at 5 s."""
    results = [_result("a", 1.0, finish), _result("b", 1.0, 5.0)]
    series = []
    for c, end in (("a", finish), ("b", 5.0)):
        series.append(_sample(c, -0.5, device_busy_s=0.0, steps=0, redis_round_trips=100))  # before the batch
        series.append(_sample(c, end + 0.1, device_busy_s=busy, steps=steps, redis_round_trips=100 + trips))
        series.append(
            _sample(c, end + 9, device_busy_s=busy, steps=steps, redis_round_trips=10**6)
        )  # idle after
    return _write(tmp / name, results, series, {"clusters": ["a", "b"], "fleet": [1, 1]})


def test_the_summary_divides_busy_seconds_by_each_span_and_makespans_by_the_0_ms_one(tmp_path):
    runs = {"0": _run(tmp_path, "r0", 5.0, 3.6, 40, 20), "100": _run(tmp_path, "r100", 9.0, 3.6, 40, 20)}
    s = summarise(runs)
    assert s["makespan_by_rtt_ms"] == {"0": 5.0, "100": 9.0}
    assert s["makespan_ratio_at_100ms"] == pytest.approx(9.0 / 5.0, abs=1e-3)
    assert s["utilization_by_cluster"]["a"] == {
        "0": pytest.approx(3.6 / 4.0),
        "100": pytest.approx(3.6 / 8.0),
    }
    assert s["utilization_by_cluster"]["b"] == {"0": pytest.approx(0.9), "100": pytest.approx(0.9)}
    assert s["utilization_by_rtt_ms"]["100"] == pytest.approx((0.45 + 0.9) / 2, abs=1e-3)
    assert s["utilization_at_100ms"] == pytest.approx(s["utilization_by_rtt_ms"]["100"] / 0.9, abs=1e-3)
    # round trips between the sample before the batch and the first heartbeat after its last finish
    assert s["redis_round_trips_per_step"] == {"0": 2.0, "100": 2.0}
    assert s["busy_source_by_rtt_ms"] == {"0": [HEARTBEAT], "100": [HEARTBEAT]}
    path = draw(s, tmp_path)
    assert path == tmp_path / PLOT and path.stat().st_size > 5000


def test_without_the_heartbeat_figures_busy_comes_from_the_cost_model_and_ratios_need_0_and_50_ms(tmp_path):
    results = [_result("a", 1.0, 3.0, prompt=100, done=50)]
    series = [_sample("a", 0.0, device_steps=0), _sample("a", 3.5, device_steps=40)]
    meta = {"clusters": ["a"], "fleet": [2.0], "device_cost_ms": "15,0.2,1"}
    d = _write(tmp_path / "old", results, series, meta)
    a = cluster_figures(d)["a"]
    busy = (40 * 0.015 + 100 * 0.0002 + 50 * 0.001) * 2.0  # a speed-2 device takes twice as long
    assert a["busy_source"] == COST_MODEL and a["device_busy_s"] == pytest.approx(busy, abs=1e-3)
    assert a["utilization"] == pytest.approx(busy / 2.0, abs=1e-3)
    assert a["redis_round_trips"] is None and a["redis_round_trips_per_step"] is None
    s = summarise({"20": d})
    assert s["makespan_ratio_at_100ms"] is None and s["utilization_at_100ms"] is None
    assert s["redis_round_trips_per_step"] == {"20": None}
    assert rtt_key(50) == "100" and rtt_key(12.5) == "25"


def test_cluster_info_carries_the_cumulative_heartbeat_figures_and_none_when_absent(redis_url):
    q = WorkQueue(connect(redis_url))
    q.heartbeat("new", 30, device_busy_s=12.5, steps=400, redis_round_trips=900)
    q.heartbeat("old", 30, running=1)
    info = {i.name: i for i in q.clusters(["new", "old"])}
    assert (info["new"].device_busy_s, info["new"].steps, info["new"].redis_round_trips) == (12.5, 400, 900)
    assert (info["old"].device_busy_s, info["old"].steps, info["old"].redis_round_trips) == (None, None, None)


def _loadgen(*argv: str, timeout: float) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "load.cli", "wan", *argv]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize(
    "argv, error",
    [
        (["--delays-ms", "0,x"], "--delays-ms: comma-separated numbers"),
        (["--delays-ms", "0,-5"], "--delays-ms: finite numbers >= 0"),
        (["--delays-ms", "10,10"], "appears twice"),
        (["--step-times", "1,0"], "--step-times: finite numbers > 0"),
        (["--step-cost", "1,2"], "--step-cost"),
    ],
)
def test_bad_options_are_a_clear_error_before_anything_starts(tmp_path, capsys, argv, error):
    assert main(["wan", *argv, "--out", str(tmp_path / "wan")]) == 1
    assert error in capsys.readouterr().err
    assert not (tmp_path / "wan").exists()


@pytest.mark.slow
def test_a_tiny_wan_run_reports_every_field_and_draws_the_plot(tmp_path):
    """One real run at 50 ms one way (the ratios against 0 ms are tested on recorded runs above)."""
    out = tmp_path / "wan"
    run = _loadgen("--delays-ms", "50", "--num-clusters", "1", "-n", "4", "--max-tokens", "8", "--dataset", "",
                   "--out", str(out), "--no-progress", "--gateway-arg=--predictor",
                   "--gateway-arg=heuristic", timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    lines = run.stdout.strip().splitlines()
    s = json.loads(lines[-1])
    assert any(line.split()[:1] == ["100"] for line in lines[:-1])  # the table, a row per RTT
    for key in (
        "utilization_by_rtt_ms",
        "utilization_by_cluster",
        "makespan_by_rtt_ms",
        "redis_round_trips_per_step",
    ):
        assert set(s[key] if key != "utilization_by_cluster" else s[key]["c1"]) == {"100"}, key
    assert 0 < s["utilization_by_rtt_ms"]["100"] <= 1 and s["makespan_by_rtt_ms"]["100"] > 0
    assert s["redis_round_trips_per_step"]["100"] > 0  # the engine's heartbeats carry its round trips
    assert s["makespan_ratio_at_100ms"] is None and s["utilization_at_100ms"] is None  # no 0 ms run
    assert (out / PLOT).stat().st_size > 5000 and s["plot"] == str(out / PLOT)
    d = out / "rtt100ms"
    meta = json.loads((d / META).read_text())
    assert meta["one_way_delay_ms"] == 50 and meta["rtt_ms"] == 100
    assert meta["proxies"][0]["accepted"] > 0  # the engine reached Redis through its proxy
    assert "redis_url" in (d / "clusters.yaml").read_text()
    assert json.loads((d / "report.json").read_text())["queries"] == 4
