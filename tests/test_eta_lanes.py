"""The ETA's lanes (gateway.status.eta): rows queued on a slow cluster wait for that cluster while later work keeps the
others busy; the last batch in order is balanced by the offloader and gets the pool estimate. Pure arithmetic."""

from __future__ import annotations

import pytest

from gateway.status.eta import ClusterLoad, EtaBoard, Lane, estimate, work_units
from workqueue import BatchInfo


def batch(batch_id: str, key: float, left: dict[str, float], rows: int = 10) -> BatchInfo:
    return BatchInfo(
        batch_id, "in_progress", rows, 0, 0, 0, 0.0, 0.0, predicted_tokens_per_cluster=dict(left), order_key=key,
        left_tokens_per_cluster=dict(left),
    )  # fmt: skip


LANES = {"fast": Lane(300.0), "slow": Lane(100.0)}  # actual tokens/s, one query at a time


def test_a_batch_on_a_slow_cluster_behind_only_later_work_gets_that_clusters_finish():
    first = batch("first", 1.0, {"slow": 1000})  # every row of the earliest batch queued on the slow cluster
    # later work keeps the fast cluster busy: nothing rescues them
    later = batch("later", 2.0, {"fast": 6000})
    etas = estimate([later, first], now=0.0, rate=400.0, prompt_share=0.0, lanes=LANES)
    pool = 1000 / 400  # the fleet as one pool: 2.5 s, four times too soon
    half_wave = 1000 / 10 * 1 / 2  # half a last wave of its rows (one slot, 100 tokens a row)
    assert etas["first"].finish_at == pytest.approx((1000 + half_wave) / 100)
    assert etas["first"].finish_at > 4 * pool
    # the last in order: the pool estimate (its lane would take 20 s), and half a last wave there
    assert etas["later"].finish_at == pytest.approx(7000 / 400 + 600 / 2 / 300)
    no_lanes = estimate([later, first], 0.0, 400.0, prompt_share=0.0)
    assert no_lanes["first"].finish_at == pytest.approx(pool)


def test_the_last_batch_gets_the_pool_estimate_and_work_after_a_batch_bounds_its_wait():
    alone = estimate([batch("only", 1.0, {"slow": 1000})], 0.0, 400.0, prompt_share=0.0, lanes=LANES)
    # nothing after it: the idle fast cluster takes its rows, all but half a last wave
    assert alone["only"].finish_at == pytest.approx(1000 / 400 + 100 / 2 / 100)
    first, later = batch("first", 1.0, {"slow": 1000}), batch("later", 2.0, {"fast": 600})
    etas = estimate([first, later], 0.0, 400.0, prompt_share=0.0, lanes=LANES)
    # rescued once the fleet has drained the rest, but for half a last wave
    assert etas["first"].finish_at == pytest.approx(1600 / 400 + 100 / 2 / 100)
    assert etas["later"].finish_at == pytest.approx(1600 / 400)  # its lane is done sooner: the pool estimate


def test_work_ahead_on_a_cluster_counts_and_a_cluster_without_its_rows_does_not_hold_it():
    urgent = batch("urgent", 1.0, {"slow": 500, "fast": 1500})
    steady = batch("steady", 2.0, {"slow": 300, "fast": 300})
    bulk = batch("bulk", 3.0, {"fast": 9000})
    etas = estimate([bulk, steady, urgent], 0.0, 400.0, prompt_share=0.0, lanes=LANES)
    row = 2000 / 10  # its mean row, wherever its rows are
    # the slow lane (the fast one: 5.3 s)
    assert etas["urgent"].finish_at == pytest.approx((500 + row / 2) / 100)
    assert etas["steady"].finish_at == pytest.approx((800 + 60 / 2) / 100)  # behind the urgent rows there
    fast_only = estimate([batch("f", 1.0, {"fast": 300}), bulk], 0.0, 400.0, prompt_share=0.0, lanes=LANES)
    assert fast_only["f"].finish_at == pytest.approx((300 + 30 / 2) / 300)
    # the slow cluster is not live: its rows count in the pool only
    gone = estimate([urgent, bulk], 0.0, 400.0, prompt_share=0.0, lanes={"fast": Lane(300.0)})
    assert gone["urgent"].finish_at == pytest.approx((1500 + row / 2) / 300)


def test_a_lane_runs_several_queries_at_once_and_the_last_wave_is_half_counted():
    b = batch("b", 1.0, {"slow": 1000})
    etas = estimate([b, batch("after", 2.0, {"fast": 9000})], 0.0, 400.0, prompt_share=0.0,
                    lanes={"fast": Lane(300.0), "slow": Lane(100.0, slots=8)})  # fmt: skip
    assert etas["b"].finish_at == pytest.approx((1000 + 100 * 8 / 2) / 100)


def test_the_board_gives_each_live_cluster_its_capacity_share_at_its_own_prompt_share():
    board = EtaBoard()
    clusters = {
        "fast": ClusterLoad(1000, 1000, capacity_tps=300.0, running=1),  # answered completions only
        # half of its answered tokens were prompt
        "slow": ClusterLoad(2000, 1000, capacity_tps=100.0, running=1),
    }
    first, later = batch("first", 1.0, {"slow": 1000}), batch("later", 2.0, {"fast": 6000})
    etas = board.update(0.0, [first, later], 3000, 3000, 400.0, 2000, clusters)
    lanes = {"fast": Lane(300.0 / work_units(0.0)), "slow": Lane(100.0 / work_units(0.5))}
    assert etas == estimate([first, later], 0.0, 400.0, board.fleet_ratio, board.prompt_share, lanes)
    pooled = board.update(0.5, [first, later], 3000, 3000, 400.0, 2000)  # no clusters: the pool
    assert etas["first"].finish_at > pooled["first"].finish_at
