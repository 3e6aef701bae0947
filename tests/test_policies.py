"""Assignment policies (gateway.assign.policies), capacity blending (gateway.assign.capacity) and the policy benchmark."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.assign.capacity import FALLBACK_TPS, effective_capacity
from gateway.assign.estimates import finish_times, tokens_per_cluster
from gateway.assign.policies import ClusterView, NoClusterError, QueryLoad, TokenPolicy, water_fill_targets
from gateway.assign.registry import POLICIES, make_policy


def qs(*predicted: float, prompt: int = 0) -> list[QueryLoad]:
    return [QueryLoad(f"q{i}", prompt, float(p)) for i, p in enumerate(predicted)]


ABC = [ClusterView("a", 1.0), ClusterView("b", 1.0), ClusterView("c", 1.0)]


# ---- data classes -------------------------------------------------------------------------------


def test_query_load_total_and_validation():
    assert QueryLoad("x", 7, 3.5).total_tokens == 10.5
    with pytest.raises(ValueError, match="prompt_tokens"):
        QueryLoad("x", -1, 3.0)
    with pytest.raises(ValueError, match="predicted_tokens"):
        QueryLoad("x", 1, float("nan"))
    with pytest.raises(ValueError, match="predicted_tokens"):
        QueryLoad("x", 1, -2.0)


def test_cluster_view_validation_and_limits():
    with pytest.raises(ValueError, match="capacity_tps"):
        ClusterView("a", -1.0)
    with pytest.raises(ValueError, match="kv_budget_tokens"):
        ClusterView("a", 1.0, kv_budget_tokens=0)
    c = ClusterView("a", 1.0, max_query_tokens=100, kv_budget_tokens=80)
    assert c.query_limit == 80
    assert c.fits(QueryLoad("x", 30, 50.0)) and not c.fits(QueryLoad("x", 30, 51.0))
    assert ClusterView("a", 1.0).query_limit == math.inf


def test_make_policy_names_choices():
    assert set(POLICIES) == {"round_robin", "least_loaded", "token", "token_equal", "prefix", "cost"}
    for name in POLICIES:
        assert make_policy(name).name == name
    with pytest.raises(ValueError, match="round_robin, least_loaded, token, token_equal, prefix"):
        make_policy("random")


# ---- round robin / least loaded -------------------------------------------------------------------


def test_round_robin_keeps_cursor_across_calls_and_skips_non_accepting():
    rr = make_policy("round_robin")
    assert rr.assign(qs(1, 1, 1, 1), ABC) == ["a", "b", "c", "a"]
    assert rr.assign(qs(1, 1), ABC) == ["b", "c"]
    clusters = [ClusterView("a", 1.0), ClusterView("b", 1.0, accepting=False), ClusterView("c", 1.0)]
    assert make_policy("round_robin").assign(qs(1, 1, 1), clusters) == ["a", "c", "a"]


def test_round_robin_skips_a_cluster_the_query_does_not_fit():
    clusters = [ClusterView("a", 1.0, max_query_tokens=10), ClusterView("b", 1.0), ClusterView("c", 1.0)]
    assert make_policy("round_robin").assign(qs(50, 5, 5, 5), clusters) == ["b", "c", "a", "b"]


def test_least_loaded_uses_queue_length_and_own_assignments():
    clusters = [
        ClusterView("a", 1.0, queue_length=3),
        ClusterView("b", 1.0, queue_length=0),
        ClusterView("c", 1.0, queue_length=1),
    ]
    assert make_policy("least_loaded").assign(qs(1, 1, 1, 1), clusters) == ["b", "b", "c", "b"]


def test_least_loaded_respects_limits():
    clusters = [ClusterView("a", 1.0, max_query_tokens=10), ClusterView("b", 1.0, queue_length=5)]
    assert make_policy("least_loaded").assign(qs(50, 5), clusters) == ["b", "a"]


# ---- token policies -------------------------------------------------------------------------------


def test_token_equal_fills_largest_deficit_longest_first():
    # Targets 80 each; 90->a, 50->b, 40->c, 30->c, 20->b, 10->b (tie b/c goes to the first).
    out = make_policy("token_equal").assign(qs(90, 50, 40, 30, 20, 10), ABC)
    assert out == ["a", "b", "c", "c", "b", "b"]
    assert tokens_per_cluster(qs(90, 50, 40, 30, 20, 10), out) == {"a": 90.0, "b": 80.0, "c": 70.0}


def test_token_equal_ignores_capacity_and_pending():
    clusters = [ClusterView("a", 1.0, pending_tokens=1000), ClusterView("b", 4.0)]
    assert make_policy("token_equal").assign(qs(10, 10, 10, 10), clusters) == ["a", "b", "a", "b"]


def test_token_capacity_weighted_hits_targets_exactly():
    clusters = [ClusterView("a", 1.0), ClusterView("b", 1.0), ClusterView("c", 2.0)]
    out = make_policy("token").assign(qs(90, 50, 40, 30, 20, 10), clusters)
    assert out == ["c", "a", "b", "c", "b", "a"]
    assert tokens_per_cluster(qs(90, 50, 40, 30, 20, 10), out) == {"a": 60.0, "b": 60.0, "c": 120.0}


def test_token_counts_prompt_tokens():
    # "long" has a short prediction but a long prompt: it is placed first (110 tokens) and fills a.
    queries = [QueryLoad("short", 0, 10.0), QueryLoad("long", 100, 10.0), QueryLoad("mid", 0, 100.0)]
    clusters = [ClusterView("a", 1.0), ClusterView("b", 1.0)]
    assert make_policy("token").assign(queries, clusters) == ["b", "a", "b"]


def test_token_subtracts_pending_work():
    clusters = [ClusterView("a", 1.0, pending_tokens=100), ClusterView("b", 1.0)]
    # Level (100 + 120) / 2 = 110: a should get 10, b 110.
    assert make_policy("token").assign(qs(60, 40, 20), clusters) == ["b", "b", "a"]
    busy = [ClusterView("a", 1.0, pending_tokens=300), ClusterView("b", 1.0)]
    assert make_policy("token").assign(qs(60, 40, 20), busy) == ["b", "b", "b"]


def test_token_memory_limit_redirects_long_queries():
    clusters = [ClusterView("a", 4.0, max_query_tokens=50), ClusterView("b", 1.0)]
    out = make_policy("token").assign(qs(100, 60, 40, 40, 40, 40, 40), clusters)
    assert out[:2] == ["b", "b"]
    assert out[2:] == ["a"] * 5


def test_token_min_concurrency_prefers_big_kv_but_falls_back():
    clusters = [ClusterView("a", 1.0, kv_budget_tokens=400), ClusterView("b", 1.0, kv_budget_tokens=4000)]
    policy = TokenPolicy(min_concurrency=4)
    # 300 > 400/4: only b is preferred; 90 <= 100 fits both.
    assert policy.assign(qs(300, 90, 90, 90), clusters) == ["b", "a", "a", "a"]
    small = [ClusterView("a", 1.0, kv_budget_tokens=400), ClusterView("b", 1.0, kv_budget_tokens=500)]
    # 300 fits both only with concurrency 1: falls back to the largest deficit among those it fits.
    assert policy.assign(qs(300), small) == ["a"]


def test_no_cluster_errors_are_clear():
    for name in POLICIES:
        with pytest.raises(NoClusterError, match="no cluster accepts"):
            make_policy(name).assign(qs(1), [ClusterView("a", 1.0, accepting=False), ClusterView("b", 0.0)])
        with pytest.raises(NoClusterError, match="'q0' needs 500"):
            make_policy(name).assign(qs(500), [ClusterView("a", 1.0, max_query_tokens=100)])
    with pytest.raises(ValueError, match="duplicate cluster names: a"):
        make_policy("token").assign(qs(1), [ClusterView("a", 1.0), ClusterView("a", 2.0)])


def test_empty_batch():
    for name in POLICIES:
        assert make_policy(name).assign([], ABC) == []


def test_water_fill_targets_exact():
    clusters = [
        ClusterView("a", 1.0, pending_tokens=50),
        ClusterView("b", 2.0),
        ClusterView("c", 1.0, pending_tokens=500),
    ]
    # c is past the level; a and b share: (50 + 250) / 3 = 100 -> a 50, b 200, c 0.
    assert water_fill_targets(clusters, 250.0) == [50.0, 200.0, 0.0]
    assert water_fill_targets(clusters, 0.0) == [0.0, 0.0, 0.0]


def test_finish_times():
    clusters = [ClusterView("a", 2.0, pending_tokens=10), ClusterView("b", 0.0)]
    assert finish_times(clusters, {"a": 10.0}) == {"a": 10.0, "b": 0.0}
    assert finish_times(clusters, {"b": 1.0})["b"] == math.inf


# ---- properties -----------------------------------------------------------------------------------

query_lists = st.lists(
    st.tuples(st.integers(0, 400), st.floats(0, 2000, allow_nan=False)), min_size=0, max_size=60
).map(lambda xs: [QueryLoad(f"q{i}", p, r) for i, (p, r) in enumerate(xs)])

cluster_lists = st.lists(
    st.tuples(st.floats(0.1, 100), st.floats(0, 1e5), st.integers(0, 50)), min_size=1, max_size=6
).map(
    lambda xs: [
        ClusterView(f"c{i}", cap, pending_tokens=p, queue_length=n) for i, (cap, p, n) in enumerate(xs)
    ]
)


@settings(max_examples=150, deadline=None)
@given(query_lists, cluster_lists, st.sampled_from(sorted(POLICIES)))
def test_every_query_assigned_once_to_an_accepting_cluster(queries, clusters, name):
    out = make_policy(name).assign(queries, clusters)
    assert len(out) == len(queries)
    assert set(out) <= {c.name for c in clusters}


@settings(max_examples=150, deadline=None)
@given(query_lists, cluster_lists, st.booleans())
def test_token_shares_within_one_query_of_targets(queries, clusters, capacity_aware):
    policy = TokenPolicy(capacity_aware=capacity_aware)
    out = policy.assign(queries, clusters)
    got = tokens_per_cluster(queries, out)
    biggest = max((q.total_tokens for q in queries), default=0.0)
    eps = 1e-6 * (1.0 + sum(q.total_tokens for q in queries))
    for c, target in zip(clusters, policy.targets(queries, clusters), strict=True):
        assert abs(got.get(c.name, 0.0) - target) <= biggest + eps


@settings(max_examples=100, deadline=None)
@given(query_lists, cluster_lists)
def test_round_robin_counts_differ_by_at_most_one(queries, clusters):
    out = make_policy("round_robin").assign(queries, clusters)
    counts = [out.count(c.name) for c in clusters]
    assert max(counts) - min(counts) <= 1


@settings(max_examples=100, deadline=None)
@given(query_lists, cluster_lists)
def test_least_loaded_ends_level(queries, clusters):
    out = make_policy("least_loaded").assign(queries, clusters)
    final = {c.name: c.queue_length + out.count(c.name) for c in clusters}
    lowest = min(final.values())
    for c in clusters:
        if out.count(c.name):
            assert final[c.name] <= lowest + 1


limited_clusters = st.lists(
    st.tuples(st.floats(0.1, 10), st.one_of(st.none(), st.integers(100, 3000)), st.integers(1, 8)),
    min_size=1,
    max_size=5,
).map(
    lambda xs: (
        [ClusterView(f"c{i}", cap, kv_budget_tokens=kv) for i, (cap, kv, _) in enumerate(xs)]
        + [ClusterView("big", 1.0, kv_budget_tokens=10_000)]
    )
)


@settings(max_examples=150, deadline=None)
@given(query_lists, limited_clusters, st.sampled_from(sorted(POLICIES)), st.integers(1, 4))
def test_queries_only_go_where_they_fit(queries, clusters, name, conc):
    policy = TokenPolicy(min_concurrency=conc) if name == "token" else make_policy(name)
    out = policy.assign(queries, clusters)
    by_name = {c.name: c for c in clusters}
    assert all(by_name[n].fits(q) for n, q in zip(out, queries, strict=True))


# ---- capacity -------------------------------------------------------------------------------------


def test_effective_capacity_rule():
    assert effective_capacity(100.0, 60.0, 500.0) == 80.0  # plan wins over hint, blended 50/50
    assert effective_capacity(None, 60.0, 500.0, alpha=0.25) == 0.25 * 60 + 0.75 * 500
    assert effective_capacity(100.0, None, None) == 100.0
    assert effective_capacity(None, 0.0, 40.0) == 40.0  # zero measurement = idle sample, ignored
    assert effective_capacity(None, 70.0, None) == 70.0
    assert effective_capacity(None, None, None) == FALLBACK_TPS
    assert effective_capacity(100.0, 60.0, None, alpha=1.0) == 60.0
    with pytest.raises(ValueError, match="alpha"):
        effective_capacity(1.0, 1.0, 1.0, alpha=1.5)
    with pytest.raises(ValueError, match="measured_tps"):
        effective_capacity(1.0, -3.0, 1.0)
    with pytest.raises(ValueError, match="plan_tps"):
        effective_capacity(float("nan"), 1.0, 1.0)


@given(
    st.one_of(st.none(), st.floats(0, 1e6)),
    st.one_of(st.none(), st.floats(0, 1e6)),
    st.one_of(st.none(), st.floats(0, 1e6)),
    st.floats(0, 1),
)
def test_effective_capacity_always_positive(plan, measured, hint, alpha):
    assert effective_capacity(plan, measured, hint, alpha) > 0


# ---- benchmark ------------------------------------------------------------------------------------


def test_compare_policies_small_run(data_root, tmp_path, capsys):
    from load.studies import compare_policies

    plot = tmp_path / "p.png"
    argv = ["--data-dir", str(data_root), "-n", "300", "--train-max", "400", "--timing-n", "0"]
    assert compare_policies.main([*argv, "--plot", str(plot)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    result = json.loads(last)
    for key in (
        "imbalance_round_robin",
        "imbalance_least_loaded",
        "imbalance_token",
        "makespan_ratio_unequal",
    ):
        assert key in result
    assert result["predictor"].startswith("tfidf+ridge")
    assert result["imbalance_token"] >= 1.0 and result["imbalance_round_robin"] >= 1.0
    assert sum(result["equal"]["token"]["queries"]) == 300
    assert sum(result["equal"]["token"]["actual_tokens"]) == sum(
        result["equal"]["round_robin"]["actual_tokens"]
    )
    assert result["makespan_ratio_unequal"] < 0.7  # capacities 1:2:4: round robin overloads the slow cluster
    assert plot.stat().st_size > 0


def test_compare_policies_bad_input(data_root, capsys):
    from load.studies import compare_policies

    assert compare_policies.main(["--data-dir", str(data_root), "-n", "5"]) == 1
    assert "-n must be at least 10" in capsys.readouterr().err
    assert compare_policies.main(["--data-dir", str(data_root), "--capacities", "1,x"]) == 1
    assert "--capacities" in capsys.readouterr().err
