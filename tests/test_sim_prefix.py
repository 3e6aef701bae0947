"""The simulator's prefix cache (issue 35, part 2): the real KV manager and scheduler hit on a group's shared
head, only uncached prefill is charged, and the prefix policy replays through the same code as the gateway's."""

from __future__ import annotations

import random

from sim.core import ClusterSpec, SimConfig, Simulator
from sim.costs import LinearCost
from sim.engines import prefix_keys
from sim.workload import Workload


def shared_workload(n: int = 240, groups: int = 12, seed: int = 0, unique: bool = False) -> Workload:
    rng = random.Random(seed)
    group = [None if rng.random() < 0.2 else rng.randrange(groups) for _ in range(n)]
    heads = [rng.randrange(200, 800) for _ in range(groups)]
    shared = [0 if g is None else heads[g] for g in group]
    prompts = [s + rng.randrange(10, 120) for s in shared]
    true = [rng.randrange(5, 120) for _ in range(n)]
    pred = [float(t) for t in true]
    if unique:
        return Workload(prompts, true, pred, [0.0] * n)
    return Workload(prompts, true, pred, [0.0] * n, prefix_group=group, prefix_tokens=shared)


def run(work: Workload, policy: str = "prefix", cache: bool = True, kv: int = 6144):
    cost = LinearCost()
    specs = [
        ClusterSpec(f"c{i}", cost.with_speed(1.0 / s), batch=8, kv_budget_tokens=kv, capacity_tps=100 / s)
        for i, s in enumerate((1.0, 2.0, 4.0))
    ]
    return Simulator(specs, work, SimConfig(policy=policy, offload=False, prefix_cache=cache)).run()


def test_a_groups_queries_share_the_keys_of_their_whole_head_blocks_and_nothing_else():
    w = shared_workload(40, 3)
    keys = {q: prefix_keys(w, q, 16, w.prompt_tokens[q] + 64) for q in range(len(w))}
    for a in range(len(w)):
        assert len(keys[a]) == -(-(w.prompt_tokens[a] + 64) // 16)
        for b in range(a + 1, len(w)):
            common = next(k for k, (x, y) in enumerate(zip(keys[a], keys[b], strict=False)) if x != y)
            ga, gb = w.prefix_group[a], w.prefix_group[b]
            assert common == (w.prefix_tokens[a] // 16 if ga is not None and ga == gb else 0)


def test_the_cache_cuts_the_prefill_charged_on_shared_prefixes_and_changes_nothing_on_unique_ones():
    shared = shared_workload()
    on, off = run(shared), run(shared, cache=False)
    assert off.prefix_hit_tokens == 0 and off.prefill_tokens >= sum(shared.prompt_tokens)
    assert on.prefix_hit_tokens > 0 and on.prefill_tokens < 0.6 * off.prefill_tokens
    assert on.prefill_tokens + on.prefix_hit_tokens >= off.prefill_tokens - off.prefix_hit_tokens - 1
    assert on.makespan_s < off.makespan_s
    unique = shared_workload(unique=True)
    on, off = run(unique, kv=65536), run(unique, cache=False, kv=65536)  # room for all: no preemption
    assert on.prefix_hit_tokens == 0
    assert on.prefill_tokens == off.prefill_tokens == sum(unique.prompt_tokens)
    assert on.makespan_s == off.makespan_s


def test_prefix_aware_assignment_hits_more_than_token_only_in_replay():
    w = shared_workload(seed=3)
    token, prefix = run(w, "token"), run(w, "prefix")
    assert prefix.hit_rate > token.hit_rate
    assert prefix.prefill_tokens < token.prefill_tokens
