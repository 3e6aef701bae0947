"""Prefix-aware assignment (issue 35, part 2): groups found from prompt heads, kept whole on one cluster
unless larger than a share, charged once per cluster, side by side in a real Redis queue."""

from __future__ import annotations

import json
import random
from collections import defaultdict

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetdata.prefixes import shared_prefix_rows
from gateway.assign.estimates import charged, charged_tokens
from gateway.assign.policies import ClusterView, QueryLoad, queue_order, water_fill_targets
from gateway.assign.prefixes import PrefixRule, find_prefixes, prefix_finder
from gateway.assign.registry import make_policy
from gateway.config import ClusterSpec, GatewayConfig
from gateway.http_api.format import render_chat
from localmodels import default_tokenizer
from protos import fleetbatch_pb2 as pb
from protos import fleetbatch_pb2_grpc as pb_grpc
from tests.harness import GatewayThread, wait_until
from workqueue import WorkQueue, connect, keys

# ---- finding groups ------------------------------------------------------------------------------


def test_groups_are_prompts_sharing_whole_blocks_of_at_least_min_tokens():
    rng = random.Random(0)
    head = [rng.randrange(50_000) for _ in range(200)]
    short = head[:40]  # shares fewer than 64 tokens: no group
    rows = [head + [rng.randrange(50_000) for _ in range(30)] for _ in range(3)]
    rows += [short + [rng.randrange(50_000) for _ in range(100)]]
    rows += [[rng.randrange(50_000) for _ in range(300)]]
    got = find_prefixes(rows)
    assert got[0][0] == got[1][0] == got[2][0] is not None
    assert {p for _, p in got[:3]} == {192}  # 200 shared tokens: 12 whole blocks of 16
    assert got[3] == (None, 0) and got[4] == (None, 0)


def test_a_group_leaves_the_last_token_and_max_tokens_uncached():
    same = list(range(100))
    got = find_prefixes([same, same], rule=PrefixRule(block=16, min_tokens=64, max_tokens=2048))
    assert got[0][1] == got[1][1] == 96  # (100 - 1) // 16 blocks: the engine computes at least one token
    got = find_prefixes([same, same], [80, 80])  # the full prompt's count bounds it, not the head's
    assert got[0][1] == 64
    got = find_prefixes([list(range(500))] * 2, rule=PrefixRule(max_tokens=128))
    assert got[0][1] == 128


def test_nested_sharing_keeps_one_coarse_group_with_each_rows_own_depth():
    base = list(range(64))
    a = base + list(range(1000, 1064))  # a and b share 128 tokens, c shares the first 64 with both
    b = base + list(range(1000, 1064))
    c = base + list(range(2000, 2064))
    got = find_prefixes([a + [1], b + [2], c + [3]])
    assert got[0][0] == got[1][0] == got[2][0]
    assert [p for _, p in got] == [128, 128, 64]


def test_chat_rows_with_one_system_message_form_one_group_through_the_serving_tokenizer():
    tok = default_tokenizer()
    system = " ".join(f"Rule {i}: answer briefly and cite the source." for i in range(12))
    chats = [
        [{"role": "system", "content": system}, {"role": "user", "content": f"Question {k}?"}]
        for k in range(4)
    ]
    chats.append([{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hello there?"}])
    prompts = [render_chat(c, tok) for c in chats]
    counts = [len(tok(p)["input_ids"]) for p in prompts]
    got = prefix_finder(tok)(prompts, counts)
    assert len({g for g, _ in got[:4]}) == 1 and got[0][0] is not None and got[4] == (None, 0)
    assert all(64 <= shared < n for (_, shared), n in zip(got[:4], counts[:4], strict=True))


def test_a_batch_with_no_groups_is_all_unique_rows(data_root):
    rows = shared_prefix_rows(12, groups=0, unique_share=1.0, root=data_root)
    assert len(rows) == 12 and all(r.meta["group"] is None for r in rows)


# ---- the policy ----------------------------------------------------------------------------------


def grouped_loads(sizes: list[int], singles: int, rng: random.Random) -> list[QueryLoad]:
    out = []
    for g, size in enumerate(sizes):
        prefix = rng.randrange(64, 400)
        for k in range(size):
            prompt = prefix + rng.randrange(1, 200)
            out.append(QueryLoad(f"g{g}-{k}", prompt, float(rng.randrange(1, 300)), f"grp{g}", prefix))
    out += [QueryLoad(f"u{k}", rng.randrange(1, 300), float(rng.randrange(1, 300))) for k in range(singles)]
    rng.shuffle(out)
    return out


@settings(max_examples=150, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 40), min_size=1, max_size=8),
    singles=st.integers(0, 40),
    caps=st.lists(st.floats(0.5, 8.0), min_size=1, max_size=5),
    pending=st.lists(st.floats(0.0, 20_000.0), min_size=5, max_size=5),
    seed=st.integers(0, 10_000),
)
def test_a_group_is_split_only_when_it_exceeds_every_share(sizes, singles, caps, pending, seed):
    loads = grouped_loads(sizes, singles, random.Random(seed))
    clusters = [
        ClusterView(f"c{i}", cap, pending_tokens=p)
        for i, (cap, p) in enumerate(zip(caps, pending[: len(caps)], strict=True))
    ]
    names = make_policy("prefix").assign(loads, clusters)
    assert len(names) == len(loads) and set(names) <= {c.name for c in clusters}
    units = defaultdict(list)
    for q in loads:
        if q.prefix_group is not None:
            units[q.prefix_group].append(q)
    share = max(
        water_fill_targets(
            clusters,
            sum(charged(u) for u in units.values())
            + sum(q.total_tokens for q in loads if q.prefix_group is None),
        )
    )
    where = defaultdict(set)
    for q, n in zip(loads, names, strict=True):
        where[q.prefix_group].add(n)
    for g, members in units.items():
        if len(where[g]) > 1:
            assert charged(members) > share, f"group {g} split though it fits a share of {share:.0f}"


def test_a_group_larger_than_every_share_is_cut_into_as_few_pieces_as_the_shares_need():
    loads = [QueryLoad(f"q{k}", 300, 100.0, "big", 200) for k in range(30)]  # charged 30 * 200 + 200
    clusters = [ClusterView("a", 1.0), ClusterView("b", 1.0), ClusterView("c", 1.0)]
    names = make_policy("prefix").assign(loads, clusters)
    assert len(set(names)) == 3  # one piece per cluster: its share is a third of the group


def test_prefix_keeps_groups_where_token_scatters_them():
    loads = grouped_loads([12] * 6, 20, random.Random(3))
    clusters = [ClusterView("a", 1.0), ClusterView("b", 2.0), ClusterView("c", 4.0)]
    scatter = {
        p: len(
            {
                n
                for q, n in zip(loads, make_policy(p).assign(loads, clusters), strict=True)
                if q.prefix_group == g
            }
        )
        for p in ("token", "prefix")
        for g in ["grp0"]
    }
    assert scatter["prefix"] == 1 and scatter["token"] > 1


def test_unique_prompts_are_assigned_and_ordered_exactly_as_token():
    rng = random.Random(5)
    loads = [QueryLoad(f"q{k}", rng.randrange(1, 500), float(rng.randrange(1, 400))) for k in range(300)]
    clusters = [
        ClusterView("a", 1.0, 500.0),
        ClusterView("b", 2.0),
        ClusterView("c", 4.0, kv_budget_tokens=600),
    ]
    token, prefix = make_policy("token"), make_policy("prefix")
    assert prefix.assign(loads, clusters) == token.assign(loads, clusters)
    assert queue_order(prefix, loads) == queue_order(token, loads)


def test_cached_prefill_is_charged_once_per_group_and_cluster():
    loads = [
        QueryLoad("a", 300, 10.0, "g", 200),
        QueryLoad("b", 300, 10.0, "g", 200),
        QueryLoad("c", 50, 5.0),
    ]
    assert charged(loads) == 310 + 110 + 55
    assert charged_tokens(loads, ["x", "x", "x"]) == [310, 110, 55]
    assert charged_tokens(loads, ["x", "y", "x"]) == [310, 310, 55]  # each cluster pays the prefix once


def test_queue_order_keeps_a_groups_rows_side_by_side():
    loads = grouped_loads([5, 7, 3], 10, random.Random(9))
    order = queue_order(make_policy("prefix"), loads)
    groups = [loads[j].prefix_group for j in order]
    for g in {q.prefix_group for q in loads} - {None}:
        at = [i for i, x in enumerate(groups) if x == g]
        assert at == list(range(at[0], at[0] + len(at)))


# ---- through the real gateway and Redis ----------------------------------------------------------


def prompt_rows(rng: random.Random) -> tuple[list[tuple[str, str, int | None]], dict[str, int | None]]:
    rows = []
    for g in range(4):
        head = " ".join(f"rule{g}x{i}" for i in range(90))  # ~hundreds of tokens, its own per group
        rows += [
            (f"g{g}-{k}", f"{head}\n\nQuestion {rng.randrange(10**9)}: what is {k}?", g) for k in range(8)
        ]
    rows += [(f"u{k}", f"Unique question {rng.randrange(10**9)} about {k}.", None) for k in range(12)]
    rng.shuffle(rows)
    return rows, {qid: g for qid, _, g in rows}


@pytest.mark.parametrize("path", ["sync", "intake"])
def test_groups_sit_together_in_each_clusters_real_queue(redis_url, monkeypatch, path):
    if path == "intake":  # every batch goes through the background intake, chunk by chunk
        monkeypatch.setenv("FLEETBATCH_INTAKE_SYNC_MAX", "1")
    config = GatewayConfig(
        redis_url=redis_url,
        policy="prefix",
        offload=False,
        clusters=[
            ClusterSpec("a", capacity_tps=100),
            ClusterSpec("b", capacity_tps=200),
            ClusterSpec("c", capacity_tps=400),
        ],
    )
    g = GatewayThread(config)
    address = g.start()
    queue = WorkQueue(connect(redis_url))
    rows, group_of = prompt_rows(random.Random(1))
    try:
        with grpc.insecure_channel(address) as ch:
            req = pb.SubmitBatchRequest(batch_id="pfx")
            for qid, prompt, _ in rows:
                req.queries.add(id=qid, prompt=prompt, max_tokens=16)
            pb_grpc.BatchServiceStub(ch).SubmitBatch(req, timeout=120)
        wait_until(lambda: sum(len(queue.queued_ids(c)) for c in "abc") == len(rows), 120, "rows queued")
        home: dict[int, set[str]] = defaultdict(set)
        for c in "abc":
            groups = [group_of[gid.split(":", 1)[1]] for gid in queue.queued_ids(c)]
            for grp in {x for x in groups if x is not None}:
                home[grp].add(c)
                at = [i for i, x in enumerate(groups) if x == grp]
                assert at == list(range(at[0], at[0] + len(at))), f"group {grp} not side by side on {c}"
        assert all(len(h) == 1 for h in home.values()), home  # small groups: never split
        # the cached prefix is charged once per group and cluster: pending holds each row's tokens less
        # the prefix its cluster's cache holds, and the groups' rows after the first hold at least 64 each
        full = 0.0
        for c in "abc":
            for gid in queue.queued_ids(c):
                q = json.loads(queue.r.hget(keys.query(gid), "payload"))
                full += q["prompt_tokens"] + q["predicted_tokens"]
        pending = sum(ci.pending_tokens for ci in queue.clusters(["a", "b", "c"]))
        assert pending <= full - 4 * 7 * 64
    finally:
        g.stop()
