"""A plan file drives the native engine: micro-batch limits and per-layer bits (real quantized layers)."""

from __future__ import annotations

from engines.config import EngineConfig
from engines.engine import LLMEngine
from engines.interface import Request, SamplingParams
from quant.linear import QuantLinear
from tests import harness


def write_plan(path, bits, decode_mb=3):
    return harness.write_plan(path, "nano", [0, len(bits)], bits, decode_mb=decode_mb)


def test_mixed_bit_plan_quantizes_layers_and_still_generates(tmp_path):
    path = tmp_path / "plan.json"
    write_plan(path, [8, 4])
    engine = LLMEngine.from_pretrained(None, size="nano", config=EngineConfig(plan_path=str(path)))
    assert engine.config.max_running == 3
    assert any("per-layer bits applied: [4, 8]" in n for n in engine.plan_notes)
    layers = engine.runner.model.model.layers
    assert isinstance(layers[0].self_attn.q_proj, QuantLinear) and layers[0].self_attn.q_proj.bits == 8
    assert isinstance(layers[1].mlp.down_proj, QuantLinear) and layers[1].mlp.down_proj.bits == 4
    for i in range(5):
        engine.add_request(Request(f"r{i}", f"question {i}", SamplingParams(max_tokens=6, forced_length=6)))
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            done[out.request_id] = out.completion_tokens
    assert done == {f"r{i}": 6 for i in range(5)}


def test_plan_for_another_layer_count_is_reported_not_applied(tmp_path):
    path = tmp_path / "plan.json"
    write_plan(path, [8, 4, 4])
    engine = LLMEngine.from_pretrained(None, size="nano", config=EngineConfig(plan_path=str(path)))
    assert any("NOT applied" in n for n in engine.plan_notes)
    assert not isinstance(engine.runner.model.model.layers[0].self_attn.q_proj, QuantLinear)
