"""`fleetbatch loadgen soak` end to end at a small size: real gateway processes, real Redis, the learned predictor."""

from __future__ import annotations

import json

from load.cli import main


def test_soak_prints_one_json_object_with_the_issue_keys(capsys):
    assert main(["soak", "-n", "300", "--drainers", "3"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    out = json.loads(last)
    for key in (
        "accepted_queries_per_s",
        "predictor_intake_ratio",
        "first_enqueue_s",
        "peak_rss_growth_mb",
        "lost",
        "duplicated",
    ):
        assert key in out, key
    assert out["lost"] == 0 and out["duplicated"] == 0
    assert out["accepted_queries_per_s"] > 0 and out["predictor_intake_ratio"] > 0
    assert [r["status"] for r in out["runs"]] == ["completed", "completed"]
