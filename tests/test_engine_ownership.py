"""The engine factory works on copies: a plan sets limits on a copy of the caller's config and
quantizes a copy of the caller's model."""

from __future__ import annotations

import pytest
import torch

from engines.config import EngineConfig
from engines.engine import LLMEngine
from localmodels import build_model, default_tokenizer, generated_corpus
from quant.linear import QuantLinear
from tests.harness import write_plan


def test_the_engine_does_not_change_the_callers_config(tmp_path):
    tok = default_tokenizer(vocab_size=1024, texts=generated_corpus(400))
    model = build_model("llama", "nano", tokenizer=tok, seed=3)
    plan = write_plan(tmp_path / "plan.json", "nano", [0, 2], [16, 16], decode_mb=3, prefill_mb=2)
    config = EngineConfig(kv_budget_tokens=512, block_size=4, plan_path=str(plan))
    before = repr(config)
    engine = LLMEngine.build(model, tok, config)
    assert engine.config.decode_micro_batch == 3  # the plan's limit, on the engine's copy
    assert repr(config) == before  # the caller's config is as it was


def test_a_plan_with_bits_quantizes_a_copy_not_the_callers_model(tmp_path):
    tok = default_tokenizer(vocab_size=1024, texts=generated_corpus(400))
    model = build_model("llama", "nano", tokenizer=tok, seed=3)
    plan = write_plan(tmp_path / "plan.json", "nano", [0, 2], [8, 4], decode_mb=3, prefill_mb=2)
    engine = LLMEngine.build(
        model, tok, EngineConfig(kv_budget_tokens=512, block_size=4, plan_path=str(plan))
    )
    assert isinstance(engine.runner.model.model.layers[1].mlp.down_proj, QuantLinear)
    assert isinstance(model.model.layers[1].mlp.down_proj, torch.nn.Linear)  # the caller's, as it was
    assert not isinstance(model.model.layers[1].mlp.down_proj, QuantLinear)


def test_a_config_with_a_plan_is_built_by_the_factory(tmp_path):
    tok = default_tokenizer(vocab_size=1024, texts=generated_corpus(400))
    model = build_model("llama", "nano", tokenizer=tok, seed=3)
    plan = write_plan(tmp_path / "plan.json", "nano", [0, 2], [16, 16], decode_mb=3, prefill_mb=2)
    with pytest.raises(ValueError, match="LLMEngine.build"):
        LLMEngine(model, tok, EngineConfig(plan_path=str(plan)))
