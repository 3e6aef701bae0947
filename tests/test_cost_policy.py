"""The cost policy and the billing model (gateway.assign.cost): the LP's split on hand-checked cases, the cost meter,
and the figures on the status page and in Prometheus (its move rules: tests/test_cost_moves.py).

The fleet of the hand-checked cases (the planned default fleet's devices, on its markets of the spot study):
``fast`` 2 x A100-40G on demand, 1,000 tokens/s, 5.86 $/h (0.00163 $ per thousand tokens); ``medium`` V100-32G + T4
spot, 400 tokens/s, 0.849 $/h (0.00059); ``slow`` 2 x T4 spot, 200 tokens/s, 0.21 $/h (0.00029). A batch of
100,000 tokens; the margin 0.8.
"""

from __future__ import annotations

import json
import socket
import urllib.request

import grpc
import pytest

from clusterfile import Cluster
from gateway.assign.cost import (
    MARGIN,
    SPOT_MARGIN,
    CostPolicy,
    _cheapest_first,
    assign_batch,
    cost_targets,
    dollars_per_token,
    fleet_cost,
    fleet_prices,
    spot_clusters,
)
from gateway.assign.loads import PROMPT_WEIGHT, ClusterView, QueryLoad
from gateway.assign.policies import water_fill_targets
from gateway.assign.registry import make_policy
from gateway.cli import build_parser
from gateway.cli_tables import cluster_table, cost_line
from gateway.config import ClusterSpec, GatewayConfig
from gateway.deploy.up import priced
from gateway.status.cost import ClusterCost, CostMeter
from gateway.status.eta import Lane, estimate
from protos import fleetbatch_pb2 as pb
from protos import fleetbatch_pb2_grpc as pb_grpc
from tests.harness import GatewayThread, batch_of, wait_until
from workqueue import BatchInfo, ClusterInfo, WorkQueue, connect

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
        [QueryLoad(f"q{i}", 0, 1000.0) for i in range(100)], FLEET, 400.0
    )[0]  # no prompts: a query's work is its response, 1,000 units
    assert "fast" not in names and names.count("slow") == 64 and names.count("medium") == 36


def test_the_split_times_a_batch_in_work_units_with_prompts_at_a_tenth():
    """The capacities count generated tokens a second; a prompt token runs in a batched prefill at a tenth of a
    generated token's cost. A batch half prompts is timed as such: 100 queries of 500 + 500 tokens are 55,000
    units, which fit slow's 320 s (64,000 units). Counted as 100,000 tokens they spilled onto medium, and a 50 s
    window read as impossible (the old model: 183 s predicted for a batch the fleet ran in 104 s)."""
    queries = [QueryLoad(f"q{i}", 500, 500.0) for i in range(100)]
    assert queries[0].work_tokens == pytest.approx(500 + PROMPT_WEIGHT * 500)
    policy = CostPolicy(PRICES)
    names, plan = policy.assign_within(queries, FLEET, 400.0)
    assert set(names) == {"slow"} and not plan.at_risk
    assert plan.targets == pytest.approx([0.0, 0.0, 100_000.0])  # back in tokens, as the token policy's
    assert plan.finish_s == pytest.approx(55_000 / 200.0)
    # 40 s of the fleet's 1,600 units a second is 64,000 units: 55,000 fit, so not at risk, fast in use
    names, plan = policy.assign_within(queries, FLEET, 50.0)
    assert not plan.at_risk and plan.finish_s <= 0.8 * 50.0 + 1e-6 and "fast" in names
    # what the clusters hold is counted at the batch's mix too: slow holding 50,000 tokens (27,500 units) has
    # room for 36,500 units (66,364 tokens) in the 320 s
    held = [FLEET[0], FLEET[1], ClusterView("slow", 200.0, pending_tokens=50_000.0)]
    _, plan = policy.assign_within(queries, held, 400.0)
    assert plan.targets[2] == pytest.approx(36_500 / 0.55, rel=1e-6) and plan.targets[0] == 0.0


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
    policy = CostPolicy(PRICES)
    caplog.clear()
    with caplog.at_level("WARNING", logger="gateway.assign.cost"):
        for _ in range(3):  # a batch's intake chunks: said once
            assign_batch(policy, queries, FLEET, 50.0, "b2")
    assert caplog.text.count("batch b2 is at risk") == 1
    # a deadline already past: at risk too
    assert cost_targets(FLEET, PRICES, BATCH, window_s=-5.0).at_risk


def test_the_closed_form_agrees_with_the_lp():
    per_token = [dollars_per_token(v, PRICES) for v in FLEET]
    room = [v.capacity_tps * MARGIN * 150.0 for v in FLEET]
    shares = _cheapest_first(per_token, room, BATCH)
    assert close([x * BATCH for x in shares], cost_targets(FLEET, PRICES, BATCH, 150.0).targets)


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


# ---------------------------------------------------------------- the meter (the billing model, tick by tick)


def info(name: str, queued: int = 0, inflight: int = 0) -> ClusterInfo:
    return ClusterInfo(name=name, queue_length=queued, inflight=inflight)


def batch(batch_id: str, left: dict[str, float]) -> BatchInfo:
    return BatchInfo(batch_id, "in_progress", 1, 0, 0, 0, 0.0, 0.0, left_tokens_per_cluster=left)


def test_the_meter_bills_clusters_while_they_hold_work_and_splits_by_tokens_left():
    meter = CostMeter({"fast": 3600.0, "slow": 360.0})  # 1 $/s and 0.1 $/s
    both = [batch("a", {"slow": 300.0}), batch("b", {"slow": 100.0})]
    meter.update(0.0, [info("fast"), info("slow", queued=4)], both)
    assert meter.rate_per_hour() == 360.0 and meter.spent == 0.0
    assert meter.batch_rates() == pytest.approx({"a": 270.0, "b": 90.0})
    meter.update(10.0, [info("fast"), info("slow", inflight=1)], [batch("a", {"slow": 50.0})])
    assert meter.spent == pytest.approx(1.0)  # 10 s of slow; fast held nothing: nothing
    assert meter.batch("a") == pytest.approx(0.75) and meter.batch("b") == pytest.approx(0.25)
    assert meter.cluster("fast") == ClusterCost(3600.0, False, 0.0)
    meter.update(20.0, [info("fast"), info("slow")], [])  # released: no work left
    assert meter.spent == pytest.approx(2.0) and meter.batch("a") == pytest.approx(1.75)
    assert meter.rate_per_hour() == 0.0 and not meter.cluster("slow").billed
    meter.update(1000.0, [info("fast"), info("slow")], [])
    assert meter.spent == pytest.approx(2.0)  # a released fleet costs nothing
    assert CostMeter().batch("never") is None


# ---------------------------------------------------------------- end to end: a real gateway, Redis, status, metrics

TOKEN = "cost-admin-token-0123456789"
KEY = "cost-http-key-0123456789"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, token: str) -> bytes:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return resp.read()


def test_end_to_end_a_loose_batch_runs_on_the_cheap_cluster_and_its_cost_is_shown(redis_url, tmp_path):
    specs = [
        ClusterSpec("fast", devices=["A100-40G", "A100-40G"], capacity_tps=1000.0),
        ClusterSpec("medium", devices=["V100-32G", "T4"], market="spot", capacity_tps=400.0),
        ClusterSpec("slow", devices=["T4", "T4"], market="spot", capacity_tps=200.0),
    ]
    metrics_port = free_port()
    config = GatewayConfig(
        redis_url=redis_url,
        policy="cost",
        admin_token=TOKEN,
        metrics_port=metrics_port,
        clusters=specs,
        http_port=0,
        http_api_key=KEY,
        files_dir=str(tmp_path / "files"),
    )
    g = GatewayThread(config)
    channel = grpc.insecure_channel(g.start())
    try:
        stub = pb_grpc.BatchServiceStub(channel)
        stub.SubmitBatch(batch_of(20, batch_id="cheap", completion_window="1h"))
        queue = WorkQueue(connect(redis_url))
        assert [c.queue_length for c in queue.clusters(["fast", "medium", "slow"])] == [0, 0, 20]
        wait_until(lambda: stub.GetBatch(pb.GetBatchRequest(batch_id="cheap")).cost_dollars > 0, 30, "a cost")
        listed = stub.ListClusters(pb.ListClustersRequest())
        rows = {c.name: c for c in listed.clusters}
        assert listed.cost_per_hour == pytest.approx(0.21) and listed.cost_dollars > 0
        assert rows["slow"].billed and rows["slow"].cost_dollars > 0 and rows["slow"].price_per_hour == 0.21
        assert (
            not rows["fast"].billed
            and rows["fast"].cost_dollars == 0.0
            and rows["fast"].price_per_hour == 5.86
        )
        assert [c.queue_length for c in queue.clusters(["fast", "medium", "slow"])] == [0, 0, 20]  # no move
        page = json.loads(get(config.http_url + "/fleet/status", KEY))
        assert page["cost_per_hour"] == pytest.approx(0.21) and page["cost_dollars"] > 0
        assert {b["id"]: b["cost_dollars"] for b in page["batches"]}["cheap"] > 0
        assert {c["name"]: c["price_per_hour"] for c in page["clusters"]}["medium"] == pytest.approx(0.849)
        scraped = get(f"http://127.0.0.1:{metrics_port}/metrics", TOKEN).decode()
        assert "fleetbatch_fleet_cost_dollars_per_hour 0.21" in scraped
        assert 'fleetbatch_batch_cost_dollars{batch="cheap"}' in scraped
        assert 'fleetbatch_cluster_price_dollars_per_hour{cluster="fast"} 5.86' in scraped
        table = cluster_table(listed.clusters) + "\n" + cost_line(listed)
        assert "fleet cost: 0.21 $/h now" in table and "5.86*" in table  # fast: released
        # slow preempted (a dry run): its queue goes where the cost split puts it, medium (cheap, on spot, with
        # room in half the hour), not mostly to fast as the water filling did
        admin = pb_grpc.AdminServiceStub(channel)
        plan = admin.DrainCluster(
            pb.DrainClusterRequest(name="slow", preempt=True, notice_s=0.0, dry_run=True),
            metadata=[("authorization", f"Bearer {TOKEN}")],
        )
        assert {m.dst for m in plan.moves} == {"medium"} and sum(m.count for m in plan.moves) == 20
    finally:
        channel.close()
        g.stop()


def test_a_planned_fleet_keeps_its_clusters_prices_and_markets():
    planned = ClusterSpec("fast", capacity_tps=1000.0, plan="plans/fast.json")  # as gateway up plans it
    assert priced(planned, None, ["A100-40G", "A100-40G"]).hourly_price() == pytest.approx(
        5.86
    )  # the default fleet
    spot = priced(planned, Cluster("fast", devices=["T4", "T4"], market="spot"), ["T4", "T4"])
    assert (
        spot.market == "spot"
        and spot.hourly_price() == pytest.approx(0.21)
        and spot.plan == "plans/fast.json"
    )


def test_under_the_cost_policy_the_eta_does_not_count_on_the_offloader_to_even_the_lanes_out():
    b = BatchInfo(
        "b",
        "in_progress",
        10,
        0,
        0,
        0,
        0.0,
        0.0,
        predicted_tokens_per_cluster={"slow": 1000.0},
        left_tokens_per_cluster={"slow": 1000.0},
    )
    lanes = {"slow": Lane(10.0), "fast": Lane(90.0)}
    balanced = estimate([b], 0.0, 100.0, prompt_share=0.0, lanes=lanes)["b"].finish_at
    alone = estimate([b], 0.0, 100.0, prompt_share=0.0, lanes=lanes, balanced=False)["b"].finish_at
    # 100 tokens a row, one at a time: half a wave is 5 s on slow. Balanced, slow's lane ends at the pool's drain
    # (1,000 tokens at 100/s); under the cost policy nothing moves its rows to fast: 1,000 tokens at 10/s
    assert balanced == pytest.approx(10.0 + 5.0) and alone == pytest.approx(100.0 + 5.0)


def test_the_spot_margin_is_a_setting():
    """A larger spot margin (``--spot-margin``) gives the spot clusters the longer share it allows; one above the
    on-demand margin counts as it; one outside (0, 1] is refused, by the policy and by the gateway's command line."""
    spot = spot_clusters(SPECS)
    # 800 s: within 0.5 of it (400 s) slow holds 80,000 and medium the rest; within 0.75 (600 s) slow holds it all
    assert close(cost_targets(FLEET, PRICES, BATCH, 800.0, spot=spot).targets, [0.0, 20_000.0, 80_000.0])
    assert close(
        cost_targets(FLEET, PRICES, BATCH, 800.0, spot=spot, spot_margin=0.75).targets, [0.0, 0.0, BATCH]
    )
    # 150 s: 0.8 x 150 = 120 s. At 0.5 (75 s) slow and medium hold 45,000 and fast the rest; at 1 (as 0.8) they
    # hold 72,000 of it
    half = cost_targets(FLEET, PRICES, BATCH, 150.0, spot=spot).targets
    whole = cost_targets(FLEET, PRICES, BATCH, 150.0, spot=spot, spot_margin=1.0).targets
    assert close(half, [55_000.0, 30_000.0, 15_000.0]) and close(whole, [28_000.0, 48_000.0, 24_000.0])
    policy = make_policy("cost", PRICES, spot, 0.75)
    assert policy.spot_margin == 0.75 and make_policy("cost", PRICES, spot).spot_margin == SPOT_MARGIN
    names = policy.assign_within([QueryLoad(f"q{i}", 0, 1000.0) for i in range(100)], FLEET, 800.0)[0]
    assert names.count("slow") == 100
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="spot margin"):
            CostPolicy(PRICES, spot=spot, spot_margin=bad)
    parser = build_parser()
    assert parser.parse_args(["serve", "--policy", "cost", "--spot-margin", "0.7"]).spot_margin == 0.7
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--spot-margin", "1.5"])


def test_spot_clusters_leave_room_for_a_preemption_where_the_window_allows():
    """A spot cluster's share is done within half the window (SPOT_MARGIN), so that a preemption's work has
    time to run elsewhere; where no split allows that, within the margin (not at risk), and only then at risk."""
    spot = spot_clusters(SPECS)
    assert spot == {"medium", "slow"} and SPOT_MARGIN == 0.5
    # 1,000 s: slow's 500 s is within half the window: all there, as without spot
    assert close(cost_targets(FLEET, PRICES, BATCH, 1000.0, spot=spot).targets, [0.0, 0.0, BATCH])
    # 800 s: 0.8 x 800 = 640 s would hold all of it on slow; 400 s holds 80,000, medium the rest
    assert close(cost_targets(FLEET, PRICES, BATCH, 800.0).targets, [0.0, 0.0, BATCH])
    plan = cost_targets(FLEET, PRICES, BATCH, 800.0, spot=spot)
    assert close(plan.targets, [0.0, 20_000.0, 80_000.0]) and not plan.at_risk
    # 90 s: 45 s of slow and medium and 72 s of fast hold 99,000: the spot clusters get the least more time that
    # holds the batch, 28,000 / 600 = 46.67 s (not all of the margin's 72 s, which left no room for a preemption)
    plan = cost_targets(FLEET, PRICES, BATCH, 90.0, spot=spot)
    assert not plan.at_risk and close(plan.targets, [72_000.0, 18_666.7, 9_333.3])
    assert cost_targets(FLEET, PRICES, BATCH, 70.0, spot=spot).at_risk  # 89,600 at most
    # the policy and the gateway's registry carry them
    policy = make_policy("cost", PRICES, spot)
    assert policy.spot == spot
    names = policy.assign_within([QueryLoad(f"q{i}", 0, 1000.0) for i in range(100)], FLEET, 800.0)[0]
    assert names.count("slow") == 80 and names.count("medium") == 20
