"""The cost policy and the billing model (gateway.assign.cost): the LP's split on hand-checked cases, the offloader's
rule under it, the cost meter, and the figures on the status page and in Prometheus.

The fleet of the hand-checked cases (the planned default fleet's devices, on its markets of the spot study):
``fast`` 2 x A100-40G on demand, 1,000 tokens/s, 5.86 $/h (0.00163 $ per thousand tokens); ``medium`` V100-32G + T4
spot, 400 tokens/s, 0.849 $/h (0.00059); ``slow`` 2 x T4 spot, 200 tokens/s, 0.21 $/h (0.00029). A batch of
100,000 tokens; the margin 0.8.
"""

from __future__ import annotations

import math

import pytest

from clusterfile import Cluster
from gateway.assign.cost import (
    MARGIN,
    CostPolicy,
    assign_batch,
    cost_targets,
    dollars_per_token,
    fleet_cost,
    fleet_prices,
    move_allowed,
)
from gateway.assign.loads import ClusterView, QueryLoad
from gateway.assign.policies import water_fill_targets
from gateway.assign.registry import make_policy

SPECS = [
    Cluster("fast", devices=["A100-40G", "A100-40G"]),
    Cluster("medium", devices=["V100-32G", "T4"], market="spot"),
    Cluster("slow", devices=["T4", "T4"], market="spot"),
]
PRICES = fleet_prices(SPECS)
FLEET = [ClusterView("fast", 1000.0), ClusterView("medium", 400.0), ClusterView("slow", 200.0)]
BATCH = 100_000.0


def close(got: list[float], want: list[float], tol: float = 1e-3) -> bool:
    return all(abs(g - w) <= tol * max(1.0, abs(w)) for g, w in zip(got, want, strict=True))


def test_prices_come_from_the_catalog_and_the_market():
    assert PRICES == pytest.approx({"fast": 5.86, "medium": (2.48 + 0.35) * 0.3, "slow": 0.7 * 0.3})
    own = Cluster("mine", devices=["T4"], market="spot", price_per_hour=0.5)
    assert fleet_prices([own, Cluster("unknown", capacity_tps=10.0)]) == {"mine": 0.5}  # its own, as it is
    per_token = [dollars_per_token(v, PRICES) * 1000 for v in FLEET]
    assert per_token == pytest.approx([5.86 / 3600, 0.849 / 3600 / 0.4, 0.21 / 3600 / 0.2], rel=1e-3)


def test_a_loose_window_uses_only_the_cheapest_cluster():
    # slow finishes 100,000 tokens in 500 s <= 0.8 x 1,000 s: all of it there
    plan = cost_targets(FLEET, PRICES, BATCH, window_s=1000.0)
    assert not plan.at_risk and close(plan.targets, [0.0, 0.0, BATCH])
    assert plan.finish_s == pytest.approx(500.0)
    assert plan.cost == pytest.approx(0.21 * 500 / 3600)


def test_a_middling_window_fills_cheap_first_and_leaves_the_dear_cluster_released():
    # 0.8 x 400 s = 320 s: slow takes 64,000, medium the other 36,000 (90 s); fast nothing
    plan = cost_targets(FLEET, PRICES, BATCH, window_s=400.0)
    assert not plan.at_risk and close(plan.targets, [0.0, 36_000.0, 64_000.0])
    names = CostPolicy(PRICES).assign_within(
        [QueryLoad(f"q{i}", 100, 900.0) for i in range(100)], FLEET, 400.0
    )[0]
    assert "fast" not in names and names.count("slow") == 64 and names.count("medium") == 36


def test_a_tight_window_uses_the_expensive_fast_cluster():
    # 0.8 x 150 s = 120 s: slow 24,000 and medium 48,000 are full; fast takes the other 28,000
    plan = cost_targets(FLEET, PRICES, BATCH, window_s=150.0)
    assert not plan.at_risk and close(plan.targets, [28_000.0, 48_000.0, 24_000.0])
    assert plan.finish_s == pytest.approx(120.0)
    hand = (5.86 * 28 + 0.849 * 120 + 0.21 * 120) / 3600
    assert plan.cost == pytest.approx(hand, rel=1e-6)


def test_an_impossible_window_falls_back_to_the_fastest_finish_at_risk(caplog):
    # 0.8 x 50 s = 40 s holds 64,000 tokens at most: the token policy's split, 62.5 s on every cluster
    plan = cost_targets(FLEET, PRICES, BATCH, window_s=50.0)
    assert plan.at_risk and plan.targets == water_fill_targets(FLEET, BATCH) == [62_500.0, 25_000.0, 12_500.0]
    assert plan.finish_s == pytest.approx(62.5)
    queries = [QueryLoad(f"q{i}", 0, 1000.0) for i in range(100)]
    with caplog.at_level("WARNING", logger="gateway.assign.cost"):
        names = assign_batch(CostPolicy(PRICES), queries, FLEET, 50.0, "b1")
    assert [names.count(c) for c in ("fast", "medium", "slow")] == [62, 25, 13] or [
        names.count(c) for c in ("fast", "medium", "slow")
    ] == [63, 25, 12]
    assert "batch b1 is at risk" in caplog.text
    # a deadline already past: at risk too
    assert cost_targets(FLEET, PRICES, BATCH, window_s=-5.0).at_risk


def test_queued_work_is_counted():
    # slow already holds 300 s of work: in a 1,000 s window (800 s) it has room for 100,000 tokens... minus 60,000
    busy = [FLEET[0], FLEET[1], ClusterView("slow", 200.0, pending_tokens=60_000.0)]
    plan = cost_targets(busy, PRICES, BATCH, window_s=1000.0)
    assert close(plan.targets, [0.0, 0.0, BATCH])  # 160,000 - 60,000 = 100,000: just fits
    busier = [FLEET[0], FLEET[1], ClusterView("slow", 200.0, pending_tokens=100_000.0)]
    plan = cost_targets(busier, PRICES, BATCH, window_s=1000.0)
    assert close(plan.targets, [0.0, 40_000.0, 60_000.0]) and plan.finish_s == pytest.approx(800.0)
    # with no room left on slow the window of 150 s takes fast and medium only
    plan = cost_targets(busier, PRICES, BATCH, window_s=150.0)
    assert close(plan.targets, [52_000.0, 48_000.0, 0.0])


def test_a_cluster_with_no_work_costs_nothing():
    assert fleet_cost(FLEET, PRICES) == 0.0
    assert fleet_cost(FLEET, PRICES, [0.0, 0.0, 200.0]) == pytest.approx(0.21 / 3600)
    held = [ClusterView("fast", 1000.0, pending_tokens=3600_000.0), FLEET[1], FLEET[2]]
    assert fleet_cost(held, PRICES) == pytest.approx(5.86)  # one hour of fast, nothing of the others


def test_equal_prices_per_token_share_the_batch_for_the_earliest_finish():
    # no prices known: every cluster free, so the split is the fastest finish (and not at risk)
    plan = cost_targets(FLEET, {}, BATCH, window_s=1000.0)
    assert not plan.at_risk and close(plan.targets, [62_500.0, 25_000.0, 12_500.0])


def test_the_policy_is_registered_with_its_prices():
    policy = make_policy("cost", PRICES)
    assert policy.name == "cost" and policy.prices == PRICES and policy.longest_first
    assert make_policy("token", PRICES).name == "token"  # the others take no prices
    # without a window (a batch with no deadline): 24 h, so all on the cheapest
    assert set(policy.assign([QueryLoad("a", 10, 100.0), QueryLoad("b", 10, 50.0)], FLEET)) == {"slow"}


def test_moves_under_the_cost_policy():
    fast, medium, slow = FLEET
    busy_slow = ClusterView("slow", 200.0, pending_tokens=100_000.0)  # 500 s of work
    assert move_allowed(busy_slow, ClusterView("slow2", 200.0), PRICES | {"slow2": 0.21}, None)  # as cheap
    assert move_allowed(ClusterView("fast", 1000.0, pending_tokens=1.0), slow, PRICES, None)  # cheaper
    assert not move_allowed(busy_slow, fast, PRICES, None)  # dearer, no deadline
    assert not move_allowed(busy_slow, fast, PRICES, 1000.0)  # dearer, on time (500 s <= 800 s)
    assert move_allowed(busy_slow, fast, PRICES, 600.0)  # 500 s > 0.8 x 600 s: it saves the deadline
    assert MARGIN == 0.8 and not math.isnan(dollars_per_token(fast, PRICES))
