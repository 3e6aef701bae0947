"""The cost policy's rules for moving queued work (gateway.assign.cost_moves): which offloader moves it allows, and
where a stopped cluster's queue goes (the drain's split and balance), on the hand-checked fleet of
tests/test_cost_policy.py; the offloader under them against a real Redis."""

from __future__ import annotations

import math

import pytest

from gateway.assign.cost import DEFAULT_WINDOW_S, MARGIN, SPOT_MARGIN, dollars_per_token
from gateway.assign.cost_moves import FILL_SHARE, evacuation_rules, fill_rule, move_allowed
from gateway.assign.loads import ClusterView, QueryLoad
from gateway.offload.moves import LinkCost
from gateway.offload.offloader import OffloadConfig, Offloader
from gateway.offload.rebalance import plan_moves
from tests.test_cost_policy import FLEET, PRICES
from workqueue import QueuedQuery, WorkQueue, connect


def test_moves_under_the_cost_policy():
    fast, medium, slow = FLEET
    busy_slow = ClusterView("slow", 200.0, pending_tokens=100_000.0)  # 500 s of work
    assert move_allowed(busy_slow, ClusterView("slow2", 200.0), PRICES | {"slow2": 0.21}, None)  # as cheap
    assert move_allowed(ClusterView("fast", 1000.0, pending_tokens=1.0), slow, PRICES, None)  # cheaper
    assert not move_allowed(busy_slow, fast, PRICES, None)  # dearer, no deadline
    assert not move_allowed(busy_slow, fast, PRICES, 1000.0)  # dearer, on time (500 s <= 800 s)
    assert move_allowed(busy_slow, fast, PRICES, 600.0)  # 500 s > 0.8 x 600 s: it saves the deadline
    # the same 100,000 tokens half prompts are 55,000 work units: 275 s <= 480 s, on time, so no dear move
    assert not move_allowed(busy_slow, fast, PRICES, 600.0, work_per_token=0.55)
    assert MARGIN == 0.8 and not math.isnan(dollars_per_token(fast, PRICES))


# ---------------------------------------------------------------- the offloader under the cost policy


def test_the_offloader_moves_work_to_a_dearer_cluster_only_to_save_a_deadline(redis_url):
    queue = WorkQueue(connect(redis_url))
    for name, tps in (("fast", 1000.0), ("slow", 200.0)):
        queue.register_cluster(name, capacity_hint_tps=tps)
        queue.heartbeat(name, ttl_s=600, tokens_per_s=tps)
    rows = [(QueuedQuery("loose", f"q{i}", "p", 8, 4, 96.0), "slow") for i in range(50)]  # 25 s of slow
    queue.create_batch("loose", rows, window_s=3600.0)
    cost = OffloadConfig(prices=PRICES)
    assert (
        Offloader(queue, cost).tick() == 0
    )  # fast is dearer per token and slow is on time: it stays released
    assert queue.clusters(["fast"])[0].queue_length == 0
    rows = [(QueuedQuery("tight", f"q{i}", "p", 8, 4, 96.0), "slow") for i in range(10)]
    queue.create_batch("tight", rows, window_s=20.0)  # slow now holds 30 s of work: past 0.8 x 20 s
    assert Offloader(queue, cost).tick() > 0  # the move saves the deadline
    assert queue.clusters(["fast"])[0].queue_length > 0


def test_the_fill_rule_under_the_cost_policy():
    fast, medium, slow = FLEET
    fill = fill_rule(PRICES, {"slow"}, 100.0)
    # cheaper on demand: FILL_SHARE of the margin of the time left; cheaper on spot: of the spot margin
    assert fill(fast, medium) == pytest.approx(FILL_SHARE * MARGIN * 100.0) == pytest.approx(72.0)
    assert fill(fast, slow) == pytest.approx(FILL_SHARE * SPOT_MARGIN * 100.0)
    assert fill(slow, fast) is None and fill(medium, medium) is None  # dearer, or as dear: equal finish times
    assert fill_rule(PRICES, (), deadlines_in_s={"a": 300.0, "b": 100.0})(fast, medium) == pytest.approx(72.0)
    assert fill_rule(PRICES, ())(fast, medium) == pytest.approx(
        FILL_SHARE * MARGIN * DEFAULT_WINDOW_S
    )  # none
    # the horizon in the moves' unit: queued tokens at 0.5 work units each take half the time a work unit does
    assert fill_rule(PRICES, (), 100.0, pending_work_per_token=0.5)(fast, medium) == pytest.approx(144.0)
    assert fill_rule(PRICES, {"slow"}, 100.0, spot_margin=0.7)(fast, slow) == pytest.approx(63.0)
    # a spot margin above the margin counts as the margin, as in the split: the fill stays inside the band below
    assert fill_rule(PRICES, {"slow"}, 100.0, spot_margin=1.0)(fast, slow) == pytest.approx(72.0)
    # the band between the fill and the move rule's trigger: work filled to the horizon is not taken back at once
    full = ClusterView("medium", 400.0, pending_tokens=400.0 * 72.0)
    assert not move_allowed(full, fast, PRICES, 100.0)


@pytest.mark.parametrize(
    ("cost", "spot", "taken"),
    [(True, (), (42, 43)), (True, ("slow",), (26, 27)), (False, (), (16, 16))],
    ids=["on-demand", "spot", "not-the-cost-policy"],
)
def test_an_idle_cheaper_cluster_takes_a_dear_clusters_tail_up_to_its_horizon(redis_url, cost, spot, taken):
    """The offloader under the cost policy: a cheap idle cluster took a dear busy one's tail only to equal finish
    times (16 of 100 queries here, 10 - 0.1 (k - 1) s > 0.5 k s up to k = 16: the token policy's balance, which it
    still is without the cost policy), and so left most of a drained queue on the dear cluster after a preempted
    spot cluster came back. Now it takes what it finishes within its horizon: 0.9 x 0.8 of the 30 s left on demand
    (21.6 s at 200 tokens/s: 43 queries of 100 tokens), 0.9 x 0.5 of it on spot (13.5 s: 27, or 26 as time
    passes)."""
    queue = WorkQueue(connect(redis_url))
    for name, tps in (("fast", 1000.0), ("slow", 200.0)):
        queue.register_cluster(name, capacity_hint_tps=tps)
        queue.heartbeat(name, ttl_s=600, tokens_per_s=tps)
    rows = [(QueuedQuery("b", f"q{i}", "p", 8, 4, 96.0), "fast") for i in range(100)]  # 10 s of fast's work
    queue.create_batch("b", rows, window_s=30.0)
    config = OffloadConfig(prices=PRICES, spot=frozenset(spot)) if cost else OffloadConfig()
    assert Offloader(queue, config).tick() > 0
    fast, slow = queue.clusters(["fast", "slow"])
    assert taken[0] <= slow.queue_length <= taken[1] and fast.queue_length == 100 - slow.queue_length


def test_an_evacuated_queue_goes_where_the_cost_split_puts_it_and_is_not_balanced_onto_a_dearer_cluster():
    """A preempted spot cluster's queue: the water filling sent most of it to fast (the most capacity) and the
    balance phase then evened the fleet out onto fast, which stayed billed all run. Under the cost policy the
    drain follows the cost split over the window and the balance makes only the moves the cost rule allows."""
    queue = [QueryLoad(f"q{i}", 0, 1000.0) for i in range(40)]  # 40,000 tokens on slow, preempted
    views = [FLEET[0], FLEET[1], ClusterView("slow", 200.0, accepting=False, queue_length=40)]
    old = plan_moves(views, {"slow": queue}, drain=["slow"])
    assert {m.dst for m in old.moves} == {"fast", "medium"}  # the water filling: fast takes 5/7
    split, allowed = evacuation_rules(PRICES, (), 1000.0)
    new = plan_moves(views, {"slow": queue}, drain=["slow"], split=split, allowed=allowed)
    assert {m.dst for m in new.moves} == {"medium"}  # 100 s <= 800 s
    assert sum(m.count for m in new.moves) == 40
    # medium on spot: its share within half the window, 500 s: still all of it
    split, allowed = evacuation_rules(PRICES, {"medium", "slow"}, 1000.0)
    spot_plan = plan_moves(views, {"slow": queue}, drain=["slow"], split=split, allowed=allowed)
    assert {m.dst for m in spot_plan.moves} == {"medium"}
    # a tight window: medium cannot finish 40,000 tokens in 0.8 x 50 s = 40 s (16,000): fast takes the rest
    moved = {"fast": 0, "medium": 0, "slow": 0}  # where the queue ends: the drain's moves and the balance's
    split, allowed = evacuation_rules(PRICES, (), 50.0)
    for m in plan_moves(views, {"slow": queue}, drain=["slow"], split=split, allowed=allowed).moves:
        moved[m.dst] += m.count
        moved[m.src] -= m.count
    # the balance, by the same split, evens the drain's rounding
    assert moved["medium"] == 16 and moved["fast"] == 24
    # at the fleet's mix (0.2 units a token: prompt-heavy rows), the queue's 44,000 tokens are 8,800 units and fit
    # medium's 16,000 units in the tight window; the move rule times medium's new work the same way
    prompts = [QueryLoad(f"p{i}", 1000, 100.0) for i in range(40)]
    split, allowed = evacuation_rules(PRICES, (), 50.0, pending_work_per_token=0.2)  # the fleet's mix alike
    prompt_plan = plan_moves(views, {"slow": prompts}, drain=["slow"], split=split, allowed=allowed)
    assert {m.dst for m in prompt_plan.moves} == {"medium"}
    # the window is the nearest deadline of the drained queries' own batches: a queue of a loose batch (1,000 s)
    # is not spread onto fast because another batch is due in 50 s (the drain's moves: those from slow)
    loose = [QueryLoad(f"loose:q{i}", 0, 1000.0) for i in range(40)]

    def drained_to(split) -> set[str]:
        return {
            m.dst
            for m in plan_moves(views, {"slow": loose}, drain=["slow"], split=split).moves
            if m.src == "slow"
        }

    assert drained_to(
        evacuation_rules(PRICES, (), 50.0, deadlines_in_s={"loose": 1000.0, "tight": 50.0})[0]
    ) == {"medium"}
    assert drained_to(evacuation_rules(PRICES, (), 50.0, deadlines_in_s={"tight": 50.0})[0]) == {
        "medium"
    }  # none: 24 h
    assert "fast" in drained_to(evacuation_rules(PRICES, (), 50.0)[0])  # the fleet's nearest, as before


def test_an_admin_balance_under_the_cost_policy_places_queued_work_by_its_split():
    """`gateway rebalance`'s balance phase: to equal finish times, fast (5/7 of the capacity) kept most of its
    queue; under the cost policy the queued work goes where the split puts it (all of it on medium, cheaper per
    token, within 0.8 of a 1,000 s window; fast, dear, only what a 50 s window needs of it)."""
    fast = ClusterView("fast", 1000.0, pending_tokens=40_000.0, queue_length=40)
    views = [fast, FLEET[1]]
    queue = {"fast": [QueryLoad(f"q{i}", 0, 1000.0) for i in range(40)]}

    def placed(window: float | None) -> dict[str, int]:
        rules = evacuation_rules(PRICES, (), window) if window else (None, None)
        out = {"fast": 40, "medium": 0}
        for m in plan_moves(views, queue, split=rules[0], allowed=rules[1]).moves:
            out[m.src] -= m.count
            out[m.dst] += m.count
        return out

    assert placed(None) == {"fast": 29, "medium": 11}  # equal finish times: 29 s and 27.5 s
    assert placed(1000.0) == {"fast": 0, "medium": 40}
    assert placed(50.0) == {"fast": 24, "medium": 16}  # medium's 0.8 x 50 s = 16,000 tokens
    # a cost balance moves up to its targets whatever the link (it pays in cost), and only when asked to
    split, allowed = evacuation_rules(PRICES, (), 1000.0)
    slow_link = LinkCost(latency_s=1e6)
    assert (
        sum(m.count for m in plan_moves(views, queue, links=slow_link, split=split, allowed=allowed).moves)
        == 40
    )
    assert plan_moves(views, queue, split=split, allowed=allowed, balance=False).moves == []
