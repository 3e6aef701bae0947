"""The vLLM backend: plan -> engine arguments everywhere; a real generation only where vLLM and a GPU exist."""

from __future__ import annotations

import importlib.util

import pytest

from engines.interface import Request, SamplingParams
from engines.vllm_backend import plan_to_vllm
from engines.vllm_engine import sampling_kwargs
from planfile import Plan, StagePlan


def make_plan(stage_layers, bits, kv_bits=16, batch=32, prefill_mb=4, prompt=512, tp=None) -> Plan:
    stages, start = [], 0
    for i, n in enumerate(stage_layers):
        stages.append(StagePlan(i, start, start + n, bits[start : start + n], 10**9, 0.1, 0.01))
        if tp:
            stages[-1].tp_device_indices = tp[i]
        start += n
    return Plan(
        model={"name": "opt-shaped", "layers": start},
        method="ilp",
        devices=[
            {"name": f"gpu{i}", "type": "V100-32G", "memory_bytes": 32 << 30, "node": 0}
            for i in range(len(stages))
        ],
        stages=stages,
        kv_bits=kv_bits,
        prefill_micro_batch=prefill_mb,
        decode_micro_batch=8,
        batch_size=batch,
        prompt_len=prompt,
        expected_output_tokens=100,
        theta=1.0,
        total_omega=0.0,
        predicted_batch_latency_s=1.0,
        predicted_throughput_tokens_per_s=100.0,
        solve_seconds=0.1,
    )


def test_pipeline_stages_become_pp_size_and_layer_partition():
    t = plan_to_vllm(make_plan([10, 14, 8], [16] * 32), "/models/x")
    assert t.engine_args["pipeline_parallel_size"] == 3
    assert t.env == {"VLLM_PP_LAYER_PARTITION": "10,14,8"}
    assert t.engine_args["quantization"] is None and t.engine_args["kv_cache_dtype"] == "auto"
    assert t.engine_args["max_num_seqs"] == 32
    assert t.engine_args["max_num_batched_tokens"] == 4 * 512
    assert t.notes == []


def test_tensor_parallel_groups_set_tp_size_and_must_agree():
    t = plan_to_vllm(make_plan([8, 8], [16] * 16, tp=[[0, 2], [1, 3]]), "/m")
    assert t.engine_args["tensor_parallel_size"] == 2 and t.engine_args["pipeline_parallel_size"] == 2
    with pytest.raises(ValueError, match="tensor-parallel sizes"):
        plan_to_vllm(make_plan([8, 8], [16] * 16, tp=[[0, 2], None]), "/m")


def test_single_stage_sets_no_partition_and_int8_maps_to_fp8():
    t = plan_to_vllm(make_plan([12], [8] * 12, kv_bits=8), "/m")
    assert t.engine_args["pipeline_parallel_size"] == 1 and t.env == {}
    assert t.engine_args["quantization"] == "fp8" and t.engine_args["kv_cache_dtype"] == "fp8"


def test_mixed_bits_are_served_at_the_widest_width_and_said_so():
    t = plan_to_vllm(make_plan([4, 4], [4, 4, 8, 8, 16, 16, 4, 4]), "/m")
    assert t.engine_args["quantization"] is None  # widest is 16
    assert any("mixed bit map [4, 8, 16]" in n for n in t.notes)
    t4 = plan_to_vllm(make_plan([4], [4] * 4), "/m")
    assert any("pre-quantized" in n for n in t4.notes)


def test_a_head_split_is_said_to_be_left_on_the_last_stage():
    plan = make_plan([10, 14, 8], [16] * 32)
    plan.head_split = 0.4
    t = plan_to_vllm(plan, "/m")
    assert t.env == {"VLLM_PP_LAYER_PARTITION": "10,14,8"}  # the layer partition stands
    assert any("40% of the LM head" in n for n in t.notes)


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="--served-model"):
        plan_to_vllm(make_plan([2], [16, 16]), "")


def test_forced_length_ignores_eos_and_fixes_the_count():
    r = Request(
        "a", "hi", SamplingParams(temperature=0.7, top_p=0.9, seed=3, max_tokens=50, forced_length=17)
    )
    assert sampling_kwargs(r) == {
        "temperature": 0.7, "top_p": 0.9, "max_tokens": 17, "seed": 3, "ignore_eos": True, "min_tokens": 17,
    }  # fmt: skip
    r = Request("b", "hi", SamplingParams(max_tokens=50))
    assert sampling_kwargs(r)["max_tokens"] == 50 and "ignore_eos" not in sampling_kwargs(r)


def _gpu_vllm() -> bool:
    if importlib.util.find_spec("vllm") is None:
        return False
    import torch

    return torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_vllm(), reason="needs vllm and a CUDA GPU")
def test_vllm_engine_generates_forced_lengths(tmp_path):
    from types import SimpleNamespace

    from engines.vllm_engine import VLLMEngine
    from localmodels import build_model, default_tokenizer

    tok = default_tokenizer()
    model = build_model("llama", "tiny", tokenizer=tok)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    engine = VLLMEngine.from_args(SimpleNamespace(served_model=str(tmp_path), plan=None, max_running=8))
    for i, n in enumerate([3, 9, 5]):
        engine.add_request(Request(f"r{i}", "hello world", SamplingParams(max_tokens=20, forced_length=n)))
    done = {}
    while engine.has_unfinished():
        for o in engine.step():
            done[o.request_id] = o.completion_tokens
    assert done == {"r0": 3, "r1": 9, "r2": 5}


def test_vllm_engine_arguments_turn_prefix_caching_on_unless_told_not_to():
    import argparse

    from engines.vllm_backend import engine_kwargs

    args = argparse.Namespace(plan=None, served_model="/models/m", max_running=32, prefix_cache=True)
    assert engine_kwargs(args) == {"model": "/models/m", "max_num_seqs": 32, "enable_prefix_caching": True}
    args.prefix_cache = False
    assert engine_kwargs(args)["enable_prefix_caching"] is False
