"""The engine works on a copy of the caller's config (a plan sets limits on the copy)."""

from __future__ import annotations

from engines.config import EngineConfig
from engines.engine import LLMEngine
from localmodels import build_model, default_tokenizer, generated_corpus
from tests.harness import write_plan


def test_the_engine_does_not_change_the_callers_config(tmp_path):
    tok = default_tokenizer(vocab_size=1024, texts=generated_corpus(400))
    model = build_model("llama", "nano", tokenizer=tok, seed=3)
    plan = write_plan(tmp_path / "plan.json", "nano", [0, 2], [16, 16], decode_mb=3, prefill_mb=2)
    config = EngineConfig(kv_budget_tokens=512, block_size=4, plan_path=str(plan))
    before = repr(config)
    engine = LLMEngine(model, tok, config)
    assert engine.config.decode_micro_batch == 3  # the plan's limit, on the engine's copy
    assert repr(config) == before  # the caller's config is as it was
