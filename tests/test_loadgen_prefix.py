"""`fleetbatch loadgen prefix` end to end at a tiny size: real `fleetbatch gateway up` runs (token-only and prefix-aware, the engines'
prefix cache on) on cost-model devices, hit rates from the heartbeats, the simulator's replay; every key of the
last JSON line. The figures themselves are the benchmark's (docs/BENCHMARKS.md)."""

from __future__ import annotations

import json

import pytest

from load.cli import main

pytestmark = (
    pytest.mark.slow
)  # two `fleetbatch gateway up` runs of three engines each, and the replay: ~2 min


def test_a_tiny_prefix_run_prints_every_figure(tmp_path, capsys, data_root):
    out = tmp_path / "prefix"
    argv = ["prefix", "--num-queries", "24", "--groups", "3", "--max-tokens", "8", "--out", str(out)]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in (
        "prefix_aware_over_token",
        "hit_rate",
        "sim_makespan_error",
        "makespan_token_s",
        "makespan_prefix_s",
    ):
        assert result[key] is not None, key
    assert result["hit_rate"] > 0  # the groups' rows found their prefix cached
    for name in ("token", "prefix"):
        run = result["runs"][name]
        assert run["completed"] == run["rows"] == 24
        assert run["sim_makespan_s"] > 0 and run["hit_rate"] is not None
        assert (out / name / "prefixes.json").exists() and (out / name / "results.jsonl").exists()
