"""Cost-model fidelity on this machine: latency fit on part of a profile grid, tested on unseen
shapes (batch 3/5/7, lengths 384/768, as in LLM-PQ); memory model against the bytes a real model
and its KV cache actually hold (weights at mixed bit widths via ``quant.apply``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

from planner.latency import Profile, decode_features, fit_linear, prefill_features
from planner.memory import MemoryModel
from planner.modelshape import ModelShape
from planner.profiler import profile_local
from quant.apply import apply_bitmap
from quant.linear import QuantLinear

log = logging.getLogger(__name__)

TEST_BATCHES = (3, 5, 7)
TEST_LENGTHS = (384, 768)
TRAIN_BATCHES = (1, 2, 4, 8)
TRAIN_LENGTHS = (128, 256, 512, 1024)


def latency_errors(profile: Profile, bits: int = 16) -> dict[str, float]:
    """Fit on the training grid of ``profile``, relative errors on the test shapes."""
    out: dict[str, float] = {}
    for phase, feats in (("prefill", prefill_features), ("decode", decode_features)):
        rows = profile.samples[bits][phase]
        train = [r for r in rows if r[0] in TRAIN_BATCHES and r[1] in TRAIN_LENGTHS]
        test = [r for r in rows if r[0] in TEST_BATCHES and r[1] in TEST_LENGTHS]
        if not train or not test:
            raise ValueError(f"profile lacks {phase} train or test points")
        coef = fit_linear([feats(v, x) for v, x, _ in train], [t for *_, t in train])
        err = [abs(float(np.dot(coef, feats(v, x))) - t) / t for v, x, t in test]
        out[f"{phase}_mean_error"] = float(np.mean(err))
        out[f"{phase}_max_error"] = float(np.max(err))
        out[f"{phase}_test_points"] = len(test)
    out["mean_latency_error"] = (out["prefill_mean_error"] + out["decode_mean_error"]) / 2
    return out


def fidelity_profile(
    shape: ModelShape,
    threads: int = 1,
    reps: int = 8,
    progress: bool = True,
    clock: str | None = None,
    min_time_s: float = 0.3,
) -> Profile:
    """One profile holding the training grid and the unseen test shapes (timed in shuffled rounds)."""
    pre = [(v, s) for v in TRAIN_BATCHES for s in TRAIN_LENGTHS] + [
        (v, s) for v in TEST_BATCHES for s in TEST_LENGTHS
    ]
    return profile_local(shape, "cpu", threads, pre, pre, reps, progress, clock=clock, min_time_s=min_time_s)


def memory_errors(
    shape: ModelShape, bits: Sequence[int], batch: int = 4, prompt_len: int = 48, output_tokens: int = 16
) -> dict[str, float]:
    """Predicted vs actual bytes: weights (mixed bits) + embeddings + head, and the KV cache after generating."""
    from transformers import AutoModelForCausalLM

    if len(bits) != shape.layers:
        raise ValueError(f"need one bit width per layer ({shape.layers}), got {len(bits)}")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(shape.hf_config()).to(torch.float16).eval()
    apply_bitmap(model, list(bits))
    actual_w = sum(p.nbytes for p in model.parameters())
    actual_w += sum(b.nbytes for m in model.modules() if isinstance(m, QuantLinear) for b in m.buffers())
    mm = MemoryModel(shape, batch, prompt_len, output_tokens, kv_bits=16)
    pred_w = (
        sum(mm.layer_weight_bytes(b) for b in bits) + mm.embedding_bytes() + mm.head_bytes(also_first=True)
    )

    ids = torch.randint(0, shape.vocab, (batch, prompt_len))
    kv_model = AutoModelForCausalLM.from_config(shape.hf_config()).to(torch.float16).eval()  # KV dtype fp16
    with torch.inference_mode():
        out = kv_model(input_ids=ids, use_cache=True)
        cache = out.past_key_values
        nxt = out.logits[:, -1:].argmax(-1)
        for _ in range(output_tokens):
            out = kv_model(input_ids=nxt, past_key_values=cache, use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
    actual_kv = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    # prompt + output_tokens tokens fed back: the cache holds prompt_len + output_tokens tokens per sequence
    mm_kv = MemoryModel(shape, batch, prompt_len, output_tokens, kv_bits=16)
    pred_kv = shape.layers * mm_kv.layer_kv_bytes()
    return {
        "weights_predicted_bytes": int(pred_w),
        "weights_actual_bytes": int(actual_w),
        "weights_error": abs(pred_w - actual_w) / actual_w,
        "kv_predicted_bytes": int(pred_kv),
        "kv_actual_bytes": int(actual_kv),
        "kv_error": abs(pred_kv - actual_kv) / actual_kv,
        "memory_error": abs(pred_w + pred_kv - actual_w - actual_kv) / (actual_w + actual_kv),
    }
