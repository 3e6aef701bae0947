"""The native engine's prefix cache: hash-chained full blocks, reference counts, LRU eviction.

Greedy outputs are token for token the same with the cache on and off (one process, under
preemption, with pipeline stages in real processes, with int8 KV), a shared prefix is computed
once, and every block's reference count is back to zero when the engine is idle (hypothesis
over random arrivals, lengths and cache sizes).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engines.config import EngineConfig
from engines.engine import LLMEngine
from engines.interface import Request, SamplingParams
from engines.kv_cache import KVCacheManager, block_key
from engines.sequence import Sequence
from localmodels import build_model, default_tokenizer, generated_corpus
from tests import harness

SYSTEM = (
    "You answer questions about rivers, cities and the weather in short plain sentences, "
    "and you always say which city you mean before you answer anything at all"
)
QUESTIONS = ["What is 2+2?", "Sort a list in python", "hi", "Explain music", "Energy prices?", "A poem"]


@pytest.fixture(scope="module")
def tokenizer():
    return default_tokenizer(vocab_size=1024, texts=generated_corpus(400))


def _requests(n: int = 12, forced: bool = True) -> list[Request]:
    out = []
    for i in range(n):
        prompt = f"{SYSTEM} {QUESTIONS[i % len(QUESTIONS)]}" if i % 4 else QUESTIONS[i % len(QUESTIONS)]
        sp = SamplingParams(max_tokens=32, forced_length=3 + i % 7 if forced else None)
        out.append(Request(f"q{i}", prompt, sp, predicted_tokens=1))
    return out


def _run(engine: LLMEngine, reqs: list[Request]) -> dict[str, list[int]]:
    """Two queries start, one more joins every step; all run to the end."""
    pending = list(reqs)
    out: dict[str, list[int]] = {}
    while engine.has_unfinished() or pending:
        if pending:
            engine.add_request(pending.pop(0))
        for o in engine.step():
            assert o.finish_reason in ("length", "stop"), o
            out[o.request_id] = o.token_ids
    return out


def _idle_and_clean(engine: LLMEngine) -> None:
    kv = engine.kv
    assert all(kv.refcount(b) == 0 for b in range(kv.num_blocks))
    assert kv.used_blocks == 0 and kv.num_free_blocks == kv.num_blocks


# ---- the block manager alone ---------------------------------------------------------------------
def _seq(rid: str, tokens: list[int]) -> Sequence:
    return Sequence(rid, list(tokens))


def test_a_second_query_takes_the_first_ones_full_blocks_and_computes_the_rest():
    kv = KVCacheManager(num_blocks=8, block_size=4, prefix_cache=True)
    a = _seq("a", list(range(10)))  # blocks [0..3] [4..7] and 2 tokens
    assert kv.lookup(a) == [] and kv.admit(a, [], 10)
    a.num_computed = 10
    kv.commit(a)
    assert kv.num_cached_blocks == 2  # the partial third block is not keyed
    b = _seq("b", [*range(8), 99, 98, 97])
    hit = kv.lookup(b)
    assert hit == a.block_table[:2]
    assert kv.admit(b, hit, 11)
    assert b.num_computed == b.num_cached_tokens == 8 and b.block_table[:2] == hit
    assert [kv.refcount(x) for x in hit] == [2, 2]
    assert kv.hit_tokens == 8 and kv.lookup_tokens == 10 + 11
    kv.free(a)
    assert [kv.refcount(x) for x in hit] == [1, 1] and kv.used_blocks == 3
    kv.free(b)
    assert kv.used_blocks == 0 and kv.num_cached_blocks == 2  # kept, not forgotten


def test_a_whole_cached_prompt_still_computes_its_last_token():
    kv = KVCacheManager(num_blocks=8, block_size=4, prefix_cache=True)
    a = _seq("a", list(range(8)))
    kv.admit(a, [], 8)
    a.num_computed = 8
    kv.commit(a)
    kv.free(a)
    b = _seq("b", list(range(8)))
    assert len(kv.lookup(b)) == 1  # of 2 full blocks: the last token must be computed to sample


def test_keys_chain_over_the_whole_prefix():
    kv = KVCacheManager(num_blocks=8, block_size=2, prefix_cache=True)
    a = _seq("a", [1, 2, 3, 4, 5])
    kv.admit(a, [], 5)
    a.num_computed = 5
    kv.commit(a)
    assert kv.lookup(_seq("b", [9, 9, 3, 4, 5])) == []  # same second block, other first block
    assert block_key(block_key(b"", [1, 2]), [3, 4]) != block_key(block_key(b"", [9, 9]), [3, 4])


def test_unheld_cached_blocks_are_evicted_least_recently_used_first_and_never_while_held():
    kv = KVCacheManager(num_blocks=4, block_size=2, prefix_cache=True)
    seqs = []
    for rid, toks in (("a", [1, 2, 3]), ("b", [4, 5, 6])):
        s = _seq(rid, toks)
        kv.admit(s, [], 3)
        s.num_computed = 3
        kv.commit(s)
        seqs.append(s)
    a_block = seqs[0].block_table[0]
    kv.free(seqs[0])
    kv.free(seqs[1])
    b_again = _seq("b2", [4, 5, 7])
    assert kv.admit(b_again, kv.lookup(b_again), 3)  # b's block is held again
    assert kv.num_cached_blocks == 2
    c = _seq("c", [8, 8, 8, 8])  # needs 2 blocks: the free one, then the oldest cached one
    assert kv.admit(c, [], 4)
    assert a_block in c.block_table and kv.lookup(_seq("a2", [1, 2, 3])) == []
    assert kv.num_cached_blocks == 1 and kv.refcount(b_again.block_table[0]) == 1
    assert not kv.allocate(_seq("d", [1]), 1)  # b's held block is never taken


def test_cache_off_keeps_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = _seq("a", [1, 2, 3, 4, 5])
    kv.admit(a, kv.lookup(a), 5)
    a.num_computed = 5
    kv.commit(a)
    kv.free(a)
    assert kv.num_cached_blocks == 0 and kv.lookup(_seq("b", [1, 2, 3, 4, 5])) == []


# ---- the engine: the same tokens with the cache on and off --------------------------------------
def _engine(tokenizer, prefix_cache: bool, **kw) -> LLMEngine:
    model = build_model("llama", "nano", tokenizer=tokenizer, seed=4)
    cfg = dict(kv_budget_tokens=1024, block_size=4, max_batch_tokens=48, prefill_chunk=12, max_running=4)
    cfg.update(kw)
    return LLMEngine(model, tokenizer, EngineConfig(prefix_cache=prefix_cache, **cfg))


@pytest.mark.parametrize(
    "kw",
    [{}, {"kv_budget_tokens": 160}, {"kv_bits": 8}],
    ids=["roomy", "preempting", "int8-kv"],
)
def test_greedy_tokens_equal_with_the_cache_on_and_off(tokenizer, kw):
    reqs = _requests(forced=False)
    off = _engine(tokenizer, False, **kw)
    want = _run(off, reqs)
    on = _engine(tokenizer, True, **kw)
    got = _run(on, _requests(forced=False))
    assert got == want
    s = on.stats()
    assert s.prefix_hit_tokens > 0 and 0 < s.prefix_hit_rate < 1
    assert off.stats().prefix_hit_tokens == 0
    if "kv_budget_tokens" in kw:
        assert on.num_preemptions > 0  # the cache takes part in preemption and recomputation
    _idle_and_clean(on)


def test_a_shared_prefix_is_prefilled_once(tokenizer):
    """Eight queries behind one long prefix: with the cache, the prefix's full blocks are computed
    by the first two queries only, admitted together before either had computed it (counted on
    the scheduler's own forward passes)."""
    prompt_ids = tokenizer(SYSTEM)["input_ids"]
    counts = {}
    for pc in (False, True):
        engine = _engine(tokenizer, pc, max_running=2)
        reqs = [
            Request(
                f"q{i}",
                "",
                SamplingParams(max_tokens=8, forced_length=2),
                prompt_token_ids=[*prompt_ids, 5 + i],
            )
            for i in range(8)
        ]
        prefill = 0
        for r in reqs:
            engine.add_request(r)
        while engine.has_unfinished():
            engine.step()
            prefill += sum(p for p, _, _ in engine.stats().step_forwards)
        counts[pc] = prefill
        _idle_and_clean(engine)
    full = len(prompt_ids) // 4 * 4
    assert counts[False] - counts[True] == 6 * full


def test_pipeline_stages_give_the_same_tokens_with_the_cache(tokenizer, tmp_path):
    """Two stages in two processes, each caching its own layers under the driver's block ids."""
    plan = harness.write_plan(tmp_path / "plan.json", "tiny", [0, 2, 4], [16, 16, 16, 16], vocab=1024)
    model = build_model("llama", "tiny", tokenizer=tokenizer, seed=3)
    one = LLMEngine(
        model,
        tokenizer,
        EngineConfig(kv_budget_tokens=96, block_size=4, prefill_chunk=8, prefix_cache=False),
    )
    want = _run(one, _requests())
    cfg = EngineConfig(
        plan_path=str(plan), kv_budget_tokens=96, block_size=4, prefill_chunk=8, prefix_cache=True
    )
    staged = LLMEngine.build(build_model("llama", "tiny", tokenizer=tokenizer, seed=3), tokenizer, cfg)
    try:
        assert staged.num_stages == 2
        got = _run(staged, _requests())
        assert staged.stats().prefix_hit_tokens > 0 and staged.num_preemptions > 0
    finally:
        staged.close()
    assert got == want
    _idle_and_clean(staged)


# ---- reference counts return to zero: random arrivals ---------------------------------------------
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    arrivals=st.lists(
        st.tuples(st.integers(0, 3), st.integers(0, 40), st.integers(1, 12), st.integers(0, 3)),
        min_size=1,
        max_size=14,
    ),
    blocks=st.integers(12, 40),
    aborts=st.sets(st.integers(0, 13), max_size=3),
)
def test_reference_counts_return_to_zero_when_idle(tokenizer, arrivals, blocks, aborts):
    """Queries arrive at random steps with one of four prefixes (or none), random tails and lengths,
    some aborted, in a cache small enough to evict and preempt. Every step, each block's count is
    the number of running queries holding it; at the end no block is held."""
    engine = _engine(tokenizer, True, kv_budget_tokens=blocks * 4, max_running=3)
    prefixes = [list(range(100 + 20 * k, 100 + 20 * k + 13 + 5 * k)) for k in range(4)]
    pending = []
    for i, (p, tail, length, at) in enumerate(arrivals):
        ids = [*(prefixes[p] if p < 3 else []), *range(500 + i, 500 + i + tail + 1)]
        sp = SamplingParams(max_tokens=16, forced_length=length)
        pending.append((at, Request(f"q{i}", "", sp, prompt_token_ids=ids, predicted_tokens=1)))
    pending.sort(key=lambda pair: pair[0])
    step = 0
    while engine.has_unfinished() or pending:
        while pending and pending[0][0] <= step:
            engine.add_request(pending.pop(0)[1])
        for rid in [f"q{i}" for i in aborts if step == 2]:
            engine.abort_request(rid)
        engine.step()
        held = [0] * engine.kv.num_blocks
        for seq in engine.scheduler.running:
            for b in seq.block_table:
                held[b] += 1
        assert held == [engine.kv.refcount(b) for b in range(engine.kv.num_blocks)]
        step += 1
    _idle_and_clean(engine)


def test_a_shared_prefix_counts_once_in_the_kv_budget(tokenizer):
    """A computes a 16-token prefix; B takes it from the cache. The running batch's committed KV is
    A's reservation plus B's own part: the prefix is not counted a second time for B."""
    engine = _engine(tokenizer, True, max_running=4, prefill_chunk=64)
    prefix = list(range(100, 116))
    for rid, tail in (("a", [7]), ("b", [8])):
        sp = SamplingParams(max_tokens=8, forced_length=4)
        engine.add_request(Request(rid, "", sp, prompt_token_ids=[*prefix, *tail], predicted_tokens=4))
        engine.step()
    s = engine.scheduler
    a, b = (s.requests[r] for r in ("a", "b"))
    assert b.num_cached_tokens == 16 and b.block_table[:4] == a.block_table[:4]
    assert s.committed_tokens() == a.reserved_tokens + b.reserved_tokens
    assert b.reserved_tokens == s.reservation(b) - 16
