"""Greedy outputs of the native engine, with queries joining and leaving at different steps, equal
token for token what ``transformers`` ``generate`` gives for each query alone."""

from __future__ import annotations

import pytest
import torch

from engines.config import EngineConfig
from engines.engine import LLMEngine
from engines.interface import Request, SamplingParams
from localmodels import build_model, default_tokenizer, generated_corpus

PROMPTS = [
    "Write a story about a river and the city beside it",
    "What is 2+2?",
    "Explain the history of music in detail please, with examples from every century",
    "hi",
    "Sort a list in python",
    "Give a short summary of the market price of energy this week",
]


@pytest.fixture(scope="module")
def tokenizer():
    return default_tokenizer(vocab_size=1024, texts=generated_corpus(400))


def _reference(model, tok, prompt: str, max_tokens: int) -> list[int]:
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False
        )
    return out[0, ids.shape[1] :].tolist()


def _run_with_insertion(
    engine: LLMEngine, reqs: list[Request]
) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Two queries start; one more joins every other step; record when each one finishes."""
    pending = list(reqs)
    for r in pending[:2]:
        engine.add_request(r)
    pending = pending[2:]
    results, finished_at, step = {}, {}, 0
    while engine.has_unfinished() or pending:
        if pending and step % 2 == 1:
            engine.add_request(pending.pop(0))
        for out in engine.step():
            assert out.finish_reason in ("length", "stop"), out
            results[out.request_id] = out.token_ids
            finished_at[out.request_id] = step
        step += 1
    return results, finished_at


@pytest.mark.parametrize("arch", ["llama", "gpt2", "opt"])
def test_greedy_with_insertion_equals_hf_generate_alone(arch, tokenizer):
    model = build_model(arch, "nano", tokenizer=tokenizer, seed=1)
    engine = LLMEngine(
        model,
        tokenizer,
        EngineConfig(
            kv_budget_tokens=1024, block_size=4, max_batch_tokens=20, prefill_chunk=6, max_running=3
        ),
    )
    reqs = [Request(f"q{i}", p, SamplingParams(max_tokens=4 + 5 * (i % 4))) for i, p in enumerate(PROMPTS)]
    got, finished_at = _run_with_insertion(engine, reqs)
    assert len(set(finished_at.values())) >= 4  # queries really left at different steps
    for r in reqs:
        assert got[r.request_id] == _reference(model, tokenizer, r.prompt, r.sampling.max_tokens), (
            r.request_id
        )
    assert engine.kv.num_free_blocks == engine.kv.num_blocks  # every block came back


def test_preemption_by_recompute_keeps_outputs_equal(tokenizer):
    """A KV budget far below the batch's needs and predictions far too short force preemptions."""
    model = build_model("llama", "nano", tokenizer=tokenizer, seed=2)
    engine = LLMEngine(
        model,
        tokenizer,
        EngineConfig(
            kv_budget_tokens=48,
            block_size=4,
            max_batch_tokens=24,
            prefill_chunk=8,
            max_running=4,
            safety_margin=0.0,
        ),
    )
    reqs = [
        Request(f"p{i}", p, SamplingParams(max_tokens=10 + 3 * i), predicted_tokens=1)
        for i, p in enumerate(PROMPTS[:5])
    ]
    outs = engine.generate(reqs)
    assert engine.num_preemptions > 0
    for r, o in zip(reqs, outs, strict=True):
        assert o.token_ids == _reference(model, tokenizer, r.prompt, r.sampling.max_tokens), r.request_id
