"""Decode attention in cache-sized chunks (``engines.decode_attention``): every query in exactly one
chunk, each chunk within its byte budget and padded only to its own longest context, and the
same attention output and the same greedy tokens as one call over the whole step. Also the
greedy pick of a pipeline whose LM head is split between two stages equals ``argmax``."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engines.config import EngineConfig
from engines.decode_attention import plan_decode
from engines.engine import LLMEngine
from engines.interface import Request, SamplingParams
from engines.model_runner import ModelRunner
from engines.pipeline import greedy_of_parts
from engines.step_batch import ChunkLayout, StepBatch
from localmodels import build_model, default_tokenizer, generated_corpus

BLOCK = 4


def _decode_batch(lengths: list[int], prefill: int = 0) -> StepBatch:
    """Decode queries with ``lengths`` tokens of context each (and one prefill of ``prefill`` tokens
    in the middle of the step), on disjoint blocks."""
    chunks, block = [], 0
    for i, n in enumerate(lengths):
        if prefill and i == len(lengths) // 2:
            per = -(-prefill // BLOCK)
            chunks.append(ChunkLayout(0, prefill, True, tuple(range(block, block + per))))
            block += per
        per = -(-n // BLOCK)
        chunks.append(ChunkLayout(n - 1, 1, True, tuple(range(block, block + per))))
        block += per
    return StepBatch(chunks, BLOCK)


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(2, 40), min_size=1, max_size=24),
    budget=st.integers(1, 4000),
    per_slot=st.sampled_from([8, 32, 100]),
    mixed=st.booleans(),
)
def test_every_query_in_one_chunk_within_budget(lengths, budget, per_slot, mixed):
    batch = _decode_batch(lengths, prefill=5 if mixed else 0)
    meta = batch.meta
    rows = None if meta.all_decode else meta.decode_rows
    plan = plan_decode(rows, meta.decode_slots, meta.decode_mask, per_slot, budget)
    covered = [r for c in plan.chunks for r in range(c.lo, c.hi)]
    assert covered == list(range(len(lengths)))
    dest = plan.rows.tolist()
    expected_rows = meta.decode_rows.tolist()
    assert sorted(dest) == sorted(expected_rows)  # each decode row once
    ctx = dict(zip(expected_rows, meta.decode_mask.view(len(lengths), -1).sum(1).tolist(), strict=True))
    for c in plan.chunks:
        widths = [ctx[r] for r in dest[c.lo : c.hi]]
        assert c.slots.shape == (c.hi - c.lo, max(widths))  # padded to its own longest context only
        assert c.mask.view(c.hi - c.lo, -1).sum(1).tolist() == widths
        if c.hi - c.lo > 1:
            assert (c.hi - c.lo) * max(widths) * per_slot <= budget


def test_without_budget_one_chunk_in_step_order():
    batch = _decode_batch([3, 9, 5])
    meta = batch.meta
    plan = plan_decode(None, meta.decode_slots, meta.decode_mask, 64, None)
    assert plan.rows is None and len(plan.chunks) == 1
    assert plan.chunks[0].slots is meta.decode_slots


def _runner(budget: int | None) -> ModelRunner:
    model = build_model("llama", "nano", seed=3)
    r = ModelRunner(model, 64, BLOCK)
    r.decode_chunk_bytes = budget
    return r


def test_chunked_attention_equals_one_call():
    lengths = [7, 30, 2, 19, 19, 11, 25, 4]
    whole, chunked = _runner(None), _runner(1)  # a budget of one byte: one query per chunk
    for r in (whole, chunked):
        torch.manual_seed(0)
        for pool in (*r.k_cache.values(), *r.v_cache.values()):
            pool.normal_()
    hidden = whole.model.config.hidden_size
    for prefill in (0, 6):
        batch = _decode_batch(lengths, prefill)
        assert len(chunked.decode_plan(batch.meta).chunks) == len(lengths)
        h = torch.randn(batch.num_tokens, hidden)
        with torch.inference_mode():
            a = whole.forward(h, batch)
            b = chunked.forward(h, batch)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_engine_greedy_tokens_unchanged_by_chunking():
    tok = default_tokenizer(vocab_size=512, texts=generated_corpus(200))
    prompts = ["a river and a city", "what is two plus two", "hi", "sort a list in python please now"]
    outs = []
    for budget in (None, 1):
        model = build_model("llama", "nano", tokenizer=tok, seed=5)
        engine = LLMEngine.build(model, tok, EngineConfig(kv_budget_tokens=512))
        engine.runner.decode_chunk_bytes = budget
        reqs = [Request(f"q{i}", p, SamplingParams(max_tokens=12)) for i, p in enumerate(prompts)]
        outs.append({o.request_id: o.token_ids for o in engine.generate(reqs)})
    assert outs[0] == outs[1]
    assert all(len(t) == 12 for t in outs[0].values())


@settings(max_examples=80, deadline=None)
@given(
    rows=st.integers(1, 6),
    vocab=st.integers(2, 40),
    cut=st.integers(1, 39),
    levels=st.integers(1, 4),
    nans=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 39)), max_size=3),
    seed=st.integers(0, 1000),
)
def test_greedy_of_two_head_parts_is_argmax_over_the_vocabulary(rows, vocab, cut, levels, nans, seed):
    """The driver's rows and the last stage's best combine to ``argmax`` of the whole logits: the
    first largest index on ties (few distinct values make many), a NaN counting as the largest."""
    cut = min(cut, vocab - 1)
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, levels, (rows, vocab), generator=g).float()
    for r, c in nans:
        if r < rows and c < vocab:
            logits[r, c] = float("nan")
    rest = logits[:, cut:].max(dim=-1)
    got = greedy_of_parts(logits[:, :cut], rest.values, rest.indices + cut)
    assert got.tolist() == logits.argmax(dim=-1).tolist()
