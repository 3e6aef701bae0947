"""A plan file drives the native engine: micro-batch limits and per-layer bits (real quantized layers)."""

from __future__ import annotations

from engines.config import EngineConfig
from engines.engine import LLMEngine
from engines.interface import Request, SamplingParams
from planner.planfile import Plan, StagePlan, save_plan
from quant.linear import QuantLinear


def write_plan(path, bits, decode_mb=3):
    plan = Plan(
        model={
            "name": "llama:nano",
            "hidden": 64,
            "layers": len(bits),
            "heads": 4,
            "kv_heads": 2,
            "intermediate": 172,
            "vocab": 8192,
        },
        method="ilp",
        devices=[{"name": "cpu0", "type": "CPU", "memory_bytes": 8 << 30, "node": "local"}],
        stages=[StagePlan(0, 0, len(bits), list(bits), 10**6, 0.01, 0.001)],
        kv_bits=16,
        prefill_micro_batch=2,
        decode_micro_batch=decode_mb,
        batch_size=8,
        prompt_len=32,
        expected_output_tokens=16,
        theta=1.0,
        total_omega=0.0,
        predicted_batch_latency_s=0.1,
        predicted_throughput_tokens_per_s=1000.0,
        solve_seconds=0.01,
    )
    save_plan(plan, path)


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
