"""`fleetbatch loadgen deadlines` end to end at a tiny size: real `fleetbatch gateway up` runs on cost-model devices, the expired
batch's files through the OpenAI front, the simulator's replay; every key of the last JSON line. Which
windows are met depends on the machine's speed: the figures are the benchmark's (docs/BENCHMARKS.md)."""

from __future__ import annotations

import json

from load.cli import main


def test_a_tiny_deadlines_run_prints_every_figure(tmp_path, capsys, data_root):
    out = tmp_path / "deadlines"
    assert main(["deadlines", "--num-queries", "24", "--orders", "edf", "--out", str(out)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("deadlines_met_edf", "eta_error_at_25pct", "eta_error_at_50pct", "sim_deadlines_met_edf"):
        assert key in result
    assert 0 <= result["deadlines_met_edf"] <= 3 and set(result["windows_s"]) == {"bulk", "urgent", "steady"}
    assert result["expired_rows_correct"] is True, result.get("expiry_problems")
    rows = result["expiry_rows"]
    assert rows["rows"] == 12 and rows["finished"] + rows["expired"] == 12 and rows["expired"] > 0
    reads = [json.loads(line) for line in (out / "edf" / "etas.jsonl").read_text().splitlines()]
    assert {r["batch"] for r in reads} == {"bulk", "urgent", "steady"}
    assert (out / "edf" / "results.jsonl").exists() and (out / "expiry" / "files.json").exists()
