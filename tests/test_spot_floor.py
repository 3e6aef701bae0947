"""The spot benchmark's cost floor (load.studies.spot_floor): rates measured on the on-demand run, each cluster's
time down from the run's events, and the cost policy's LP with them, on hand-checked cases."""

from __future__ import annotations

import pytest

from load.studies.spot_floor import cost_floor, downtime, measured_rates
from load.studies.spot_stats import summarise

T0 = 1000.0
PRICES = {"fast": 36.0, "slow": 1.0}  # dollars an hour: 0.01 and 1/3600 a second


def row(cluster: str, finished: float, completion: int = 90, prompt: int = 100) -> dict:
    """A row of 100 work units: 90 generated tokens and a prompt of 100 at a tenth each (PROMPT_WEIGHT)."""
    return {"query_id": f"{cluster}-{finished}", "cluster": cluster, "prompt_tokens": prompt,
            "completion_tokens": completion, "timings": {"finished_at": T0 + finished}}  # fmt: skip


def on_demand() -> dict:
    """fast answers 10 rows of 100 work units in 10 s (100 a second), slow 2 in 20 s (10 a second)."""
    rows = [row("fast", 1.0 + i) for i in range(10)] + [row("slow", 10.0), row("slow", 20.0)]
    meta = {"created_at": T0, "completed_at": T0 + 20, "cost_dollars": 0.5, "events": [], "window_s": None,
            "deadline": 0, "status": "COMPLETED"}  # fmt: skip
    return {"rows": rows, "meta": meta, "costs": [], "total": len(rows)}


def spot_run(window: float, slow_down_s: float = 0.0) -> dict:
    """1000 work units (10 rows), slow down for ``slow_down_s`` from its engine's stop (a notice, then its next
    engine's first heartbeat)."""
    events, processes = [], []
    if slow_down_s:
        events = [{"kind": "preempt", "cluster": "slow", "t": T0 + 5, "stopped_t": T0 + 6, "back_t": T0 + 7,
                   "partial": {}, "running": []}]  # fmt: skip
        processes = [{"cluster": "slow", "start": T0 - 1, "generated": 0},
                     {"cluster": "slow", "start": T0 + 6 + slow_down_s, "generated": 0}]  # fmt: skip
    meta = {"created_at": T0, "completed_at": T0 + 50, "window_s": window, "events": events, "processes": processes,
            "cost_dollars": 0.1, "deadline": T0 + window, "status": "COMPLETED", "batch_id": "b"}  # fmt: skip
    return {"rows": [row("fast", 1.0) for _ in range(10)], "meta": meta, "costs": [], "total": 10}


def test_rates_are_measured_on_the_on_demand_run_and_downtime_ends_at_the_next_engine():
    assert measured_rates(on_demand()) == {"fast": pytest.approx(100.0), "slow": pytest.approx(10.0)}
    assert downtime(spot_run(200.0, slow_down_s=100.0)) == {"slow": pytest.approx(100.0)}
    assert downtime(spot_run(200.0)) == {}


def test_a_loose_window_puts_everything_on_the_cheap_cluster():
    floor = cost_floor(spot_run(200.0), measured_rates(on_demand()), PRICES)
    # slow can do 10 x 0.8 x 200 = 1600 units: all 1000 there, 100 s at 1/3600 $ a second
    assert floor["cost_dollars"] == pytest.approx(100 / 3600, abs=1e-5) and not floor["at_risk"]
    assert floor["share"] == {"fast": 0.0, "slow": 1.0}


def test_time_down_sends_the_rest_to_the_dear_cluster():
    floor = cost_floor(spot_run(200.0, slow_down_s=100.0), measured_rates(on_demand()), PRICES)
    # slow has 160 - 100 = 60 s: 600 units (60 s of 1/3600 $); fast the other 400 (4 s of 0.01 $)
    assert floor["cost_dollars"] == pytest.approx(60 / 3600 + 0.04, abs=1e-5)
    assert floor["share"] == {"fast": 0.4, "slow": 0.6} and floor["billed_s"] == {"fast": 4.0, "slow": 60.0}


def test_a_window_no_split_meets_is_at_risk():
    floor = cost_floor(spot_run(10.0), measured_rates(on_demand()), PRICES)  # 8 s x 110 units < 1000
    assert floor["at_risk"]


def test_the_summary_reports_the_floors_ratios():
    runs = {"on_demand": on_demand(), "cost_loose": spot_run(200.0), "token_loose": spot_run(200.0)}
    out = summarise(runs, ["loose"], prices=PRICES)
    assert out["cost_floor_vs_token_same_fleet"] == round((100 / 3600) / 0.1, 3)
    assert out["cost_floor_vs_on_demand"] == round((100 / 3600) / 0.5, 3)
    assert summarise(runs, ["loose"])["cost_floor_vs_on_demand"] is None  # no prices, no floor
