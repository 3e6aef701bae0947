"""`fleetbatch gateway rebalance` planning (gateway.offload.rebalance): exact plans, drains, and conservation properties."""

from __future__ import annotations

import math
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.assign.policies import ClusterView, NoClusterError, QueryLoad
from gateway.offload.moves import LinkCost, Move
from gateway.offload.rebalance import (
    balance_targets,
    expected_finish_s,
    format_plan,
    plan_moves,
    plan_rebalance,
    simulate_moves,
)

FREE = LinkCost(latency_s=0.0, bandwidth_bytes_per_s=1e15)


def queue(prefix: str, n: int, tokens: float = 100.0) -> list[QueryLoad]:
    return [QueryLoad(f"{prefix}{i}", 0, tokens) for i in range(n)]


def example():
    clusters = [
        ClusterView("a", 1.0, pending_tokens=1000, queue_length=10),
        ClusterView("b", 1.0),
        ClusterView("c", 2.0, pending_tokens=100, queue_length=1),
    ]
    return clusters, {"a": queue("a", 10), "c": queue("c", 1)}


def test_expected_finish_s():
    assert expected_finish_s(ClusterView("a", 4.0, pending_tokens=100)) == 25.0
    assert expected_finish_s(ClusterView("a", 4.0, pending_tokens=100), extra_tokens=20) == 30.0
    assert expected_finish_s(ClusterView("a", 0.0, pending_tokens=1)) == math.inf
    assert expected_finish_s(ClusterView("a", 0.0)) == 0.0


def test_balance_plan_exact():
    clusters, queued = example()
    # Level 1100 / 4 = 275 s: targets a 275, b 275, c 550 tokens; a gives 3 to b, then 4 to c.
    moves = plan_rebalance(clusters, queued, links=FREE)
    assert moves == [Move("a", "b", 3, 300.0), Move("a", "c", 4, 400.0)]
    after, queues = simulate_moves(clusters, queued, moves)
    assert [c.pending_tokens for c in after] == [300.0, 300.0, 500.0]
    assert [c.queue_length for c in after] == [3, 3, 5]
    assert [q.key for q in queues["b"]] == ["a7", "a8", "a9"]
    assert [q.key for q in queues["c"]] == ["c0", "a3", "a4", "a5", "a6"]


def test_drain_moves_everything_queued_in_capacity_shares():
    clusters, queued = example()
    moves = plan_rebalance(clusters, queued, drain=["a"], links=FREE)
    assert moves == [Move("a", "c", 7, 700.0), Move("a", "b", 3, 300.0)]
    after, queues = simulate_moves(clusters, queued, moves)
    assert queues["a"] == [] and after[0].pending_tokens == 0.0


def test_not_accepting_cluster_is_drained():
    clusters, queued = example()
    clusters[0] = ClusterView("a", 1.0, pending_tokens=1000, queue_length=10, accepting=False)
    assert plan_rebalance(clusters, queued, links=FREE) == plan_rebalance(*example(), drain=["a"], links=FREE)


def test_running_work_stays():
    # a holds 1000 tokens but only two 100-token queries are still queued.
    clusters = [ClusterView("a", 1.0, pending_tokens=1000), ClusterView("b", 1.0)]
    assert plan_rebalance(clusters, {"a": queue("a", 2)}, links=FREE) == [Move("a", "b", 2, 200.0)]
    assert balance_targets(clusters, [200.0, 0.0]) == [800.0, 200.0]


def test_new_cluster_gets_work():
    clusters = [ClusterView("a", 1.0, pending_tokens=600), ClusterView("new", 2.0)]
    assert plan_rebalance(clusters, {"a": queue("a", 6)}, links=FREE) == [Move("a", "new", 4, 400.0)]


def test_balanced_or_costly_gives_no_moves():
    clusters = [ClusterView("a", 1.0, pending_tokens=300), ClusterView("b", 1.0, pending_tokens=300)]
    assert plan_rebalance(clusters, {"a": queue("a", 3), "b": queue("b", 3)}, links=FREE) == []
    clusters, queued = example()
    assert plan_rebalance(clusters, queued, links=LinkCost(latency_s=5000.0)) == []


def test_per_link_costs_steer_moves():
    clusters, queued = example()
    links = {("a", "b"): LinkCost(latency_s=5000.0), ("a", "c"): FREE, ("b", "c"): FREE}
    moves = plan_rebalance(clusters, queued, links=links)
    assert moves and all(m.dst == "c" for m in moves)


def test_memory_limits_respected():
    clusters = [ClusterView("a", 1.0, pending_tokens=1000), ClusterView("b", 1.0, max_query_tokens=150)]
    queued = {"a": [*queue("s", 5), *queue("l", 5, tokens=200)]}  # back of the queue is long: nothing moves
    assert plan_rebalance(clusters, queued, links=FREE) == []
    # draining a: the long queries fit nowhere and stay (reported); the short ones move past them
    plan = plan_moves(clusters, queued, drain=["a"], links=FREE)
    assert plan.moves == [Move("a", "b", 5, 500.0)]
    assert plan.moves[0].keys == tuple(f"s{i}" for i in range(5))
    assert [q.key for q in plan.kept["a"]] == [f"l{i}" for i in range(5)]
    assert plan.kept_lines() == [
        "a keeps 5 queued queries that fit on no accepting cluster: 'l0', 'l1', 'l2', 'l3', 'l4'"
    ]
    after, queues = simulate_moves(clusters, queued, plan.moves)
    assert [q.key for q in queues["a"]] == [f"l{i}" for i in range(5)]


def test_errors_are_clear():
    clusters, queued = example()
    with pytest.raises(ValueError, match="cannot drain unknown clusters: zz"):
        plan_rebalance(clusters, queued, drain=["zz"])
    with pytest.raises(ValueError, match="unknown clusters: zz"):
        plan_rebalance(clusters, {"zz": queue("z", 1)})
    with pytest.raises(NoClusterError, match="cannot drain 'a'"):
        plan_rebalance([clusters[0]], {"a": queued["a"]}, drain=["a"])
    with pytest.raises(ValueError, match="has 10 queued"):
        simulate_moves(clusters, queued, [Move("a", "b", 11, 0.0)])


def test_format_plan_lists_clusters_and_moves():
    clusters, queued = example()
    moves = plan_rebalance(clusters, queued, links=FREE)
    after, _ = simulate_moves(clusters, queued, moves)
    text = format_plan(clusters, after, moves)
    assert "move 3 queries (300 tokens) from the back of a to b" in text
    assert text.splitlines()[1].split()[:4] == ["a", "1.0", "1000", "1000.0"]
    assert "no moves" in format_plan(clusters, clusters, [])


cluster_specs = st.lists(
    st.tuples(
        st.floats(0.1, 20),  # capacity
        st.floats(0, 2000),  # running (not movable) tokens
        st.lists(st.tuples(st.integers(0, 200), st.floats(0, 800)), max_size=12),  # queue
        st.booleans(),  # accepting
        st.sampled_from([None, 300, 1000]),  # per-query limit
    ),
    min_size=2,
    max_size=5,
)


def build(specs):
    clusters, queued = [], {}
    for i, (cap, running, items, accepting, limit) in enumerate(specs):
        q = [QueryLoad(f"c{i}-{j}", p, r) for j, (p, r) in enumerate(items)]
        name = f"c{i}"
        clusters.append(
            ClusterView(
                name,
                cap,
                pending_tokens=running + sum(x.total_tokens for x in q),
                queue_length=len(q),
                max_query_tokens=limit,
                accepting=accepting,
            )
        )
        queued[name] = q
    return clusters, queued


@settings(max_examples=200, deadline=None)
@given(cluster_specs, st.data())
def test_rebalance_conserves_queries_and_never_raises_the_makespan(specs, data):
    clusters, queued = build(specs)
    drain = data.draw(st.lists(st.sampled_from([c.name for c in clusters]), max_size=2, unique=True))
    try:
        plan = plan_moves(clusters, queued, drain=drain, links=LinkCost(0.001, 1e9))
    except NoClusterError:
        return  # nothing accepts: reported, nothing planned
    moves = plan.moves
    after, queues = simulate_moves(clusters, queued, moves)
    before_keys = Counter(q.key for qs in queued.values() for q in qs)
    after_keys = Counter(q.key for qs in queues.values() for q in qs)
    assert before_keys == after_keys and all(v == 1 for v in after_keys.values())
    drained = set(drain) | {c.name for c in clusters if not c.accepting}
    by_name = {c.name: c for c in after}
    for m in moves:
        assert m.count > 0 and m.src != m.dst and m.dst not in drained
    receivers = [c for c in clusters if c.usable and c.name not in drained]
    for name, qs in queues.items():
        if name in drained:  # a drained cluster keeps exactly the queries that fit on no receiver
            assert [q.key for q in qs] == [q.key for q in plan.kept.get(name, [])]
            assert not any(r.fits(q) for q in qs for r in receivers)
        for q in qs:
            if q.key not in {x.key for x in queued[name]}:
                assert by_name[name].fits(q)  # moved queries only go where they fit
    live = [c for c in clusters if c.name not in drained and c.usable]
    if not drained:
        before = max(expected_finish_s(c) for c in live)
        assert max(expected_finish_s(by_name[c.name]) for c in live) <= before * (1 + 1e-9) + 1e-9
