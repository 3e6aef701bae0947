"""When each cluster finished, and how far apart (``finish_spread``): ``fleetbatch loadgen report`` on a run
directory written here, and the study's ``finish_spread_unequal`` (issue 33: in the 1:2:4 run the
clusters should finish together)."""

from __future__ import annotations

import pytest

from load.reports.report import build_report, finish_spread
from load.reports.runrecord import write_run
from load.studies.study import ratios


def row(cluster: str, enqueued: float, finished: float) -> dict:
    return {
        "query_id": f"{cluster}-{finished}",
        "cluster": cluster,
        "completion_tokens": 4,
        "timings": {"enqueued_at": enqueued, "finished_at": finished},
    }


def test_the_spread_is_the_last_clusters_finish_minus_the_firsts_over_the_makespan(tmp_path):
    rows = [  # enqueued at 100; c1 done at 37 s, c2 at 40 s, c3 (the fast one) last at 47 s
        row("c1", 100.0, 120.0), row("c1", 100.0, 137.0),
        row("c2", 100.0, 140.0),
        row("c3", 100.0, 110.0), row("c3", 100.0, 147.0),
        {"query_id": "never-ran", "cluster": "", "timings": {"enqueued_at": 100.0, "finished_at": 101.0}},
    ]  # fmt: skip
    write_run(tmp_path / "run", rows, {"policy": "token", "fleet": [1.0, 2.0, 4.0]})
    report = build_report(tmp_path / "run", plots=False)
    assert report["finish_by_cluster"] == {"c1": 37.0, "c2": 40.0, "c3": 47.0}
    assert report["finish_spread"] == pytest.approx((47 - 37) / 47, abs=1e-4)
    study = ratios({"token_iteration_unequal": report, "rr_iteration_unequal": report})
    assert study["finish_spread_unequal"] == report["finish_spread"]
    assert study["qi_over_rr_iteration_unequal"] == 1.0


def test_one_cluster_has_no_spread_and_clusters_finishing_together_have_none():
    assert finish_spread([row("c1", 0.0, 5.0), row("c1", 0.0, 9.0)]) == ({"c1": 9.0}, None)
    assert finish_spread([row("c1", 0.0, 9.0), row("c2", 1.0, 9.0)]) == ({"c1": 9.0, "c2": 9.0}, 0.0)
    assert finish_spread([]) == ({}, None)
    assert "finish_spread_unequal" not in ratios({"token_iteration_equal": {"finish_spread": 0.1}})
