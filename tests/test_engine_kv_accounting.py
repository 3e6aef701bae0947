"""KV accounting for MICO's cumulative-KV metric: each engine reports the KV it held during its last
step; static batching holds the whole batch's KV until its longest query ends, iteration-level
batching frees a query's blocks as soon as it finishes."""

from __future__ import annotations

import itertools

import pytest

from engines.config import EngineConfig
from engines.engine import LLMEngine
from engines.interface import Request, SamplingParams
from engines.static_engine import StaticBatchEngine
from localmodels import build_model, default_tokenizer, generated_corpus


@pytest.fixture(scope="module")
def parts():
    tok = default_tokenizer(vocab_size=1024, texts=generated_corpus(400))
    return build_model("llama", "nano", tokenizer=tok, seed=3), tok


def add(engine, lengths: list[int]) -> None:
    for i, n in enumerate(lengths):
        engine.add_request(Request(f"r{i}", "Write a story", SamplingParams(max_tokens=64, forced_length=n)))


def kv_per_step(engine) -> list[int]:
    out = []
    while engine.has_unfinished():
        engine.step()
        out.append(engine.stats().kv_step_tokens)
    return out


def test_iteration_level_kv_shrinks_as_queries_finish(parts):
    model, tok = parts
    e = LLMEngine(model, tok, EngineConfig(kv_budget_tokens=512, block_size=4))
    add(e, [2, 30])
    steps = kv_per_step(e)
    assert steps[0] > 0 and any(b < a for a, b in itertools.pairwise(steps))  # short one freed early
    assert e.stats().kv_used_tokens == 0


def test_static_batch_holds_the_whole_batch_until_the_longest_ends(parts):
    model, tok = parts
    e = StaticBatchEngine(model, tok, max_batch=4)
    add(e, [2, 30])
    steps = kv_per_step(e)
    prompt = len(tok("Write a story", add_special_tokens=True)["input_ids"])
    assert steps == [2 * (prompt + 30)]
    e.step()
    assert e.stats().kv_step_tokens == 0  # idle
