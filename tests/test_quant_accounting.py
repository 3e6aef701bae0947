"""Exact byte accounting: formulas equal the nbytes of what QuantLinear / a quantized layer store."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, LlamaConfig, OPTConfig, Qwen2Config

from localmodels import build_model
from quant.accounting import (
    decoder_layer_weight_bytes,
    kv_bytes_per_token,
    layer_linear_shapes,
    non_layer_weight_bytes,
    packed_linear_bytes,
)
from quant.apply import apply_bitmap, bitmap_weight_bytes, decoder_layers
from quant.kv import kv_stored_bytes, quantize_kv
from quant.linear import QuantLinear


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("group_size", [None, 32, 128])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("shape", [(200, 64), (13, 7)])
def test_quantlinear_bytes_exact(bits, group_size, symmetric, shape):
    lin = torch.nn.Linear(*shape, bias=True)
    q = QuantLinear.from_module(lin, bits, group_size, symmetric)
    assert q.stored_bytes() == packed_linear_bytes(*shape, bits, group_size, symmetric, bias=True)


def test_fp16_and_packing_ratios():
    assert packed_linear_bytes(128, 10, 16) == 128 * 10 * 2
    # 4-bit: two codes per byte; 3-bit: 8 codes in 3 bytes; plus one fp16 scale per row
    assert packed_linear_bytes(128, 10, 4, group_size=None) == 10 * 64 + 10 * 2
    assert packed_linear_bytes(128, 10, 3, group_size=None) == 10 * 48 + 10 * 2
    assert packed_linear_bytes(128, 10, 2, group_size=64, symmetric=False) == 10 * 32 + 10 * 2 * 2 + 10 * 2
    with pytest.raises(ValueError, match="bit width"):
        packed_linear_bytes(128, 10, 5)


@pytest.mark.parametrize("arch", ["llama", "opt", "gpt2"])
@pytest.mark.parametrize("bits", [16, 8, 4, 3])
def test_decoder_layer_bytes_equal_stored(arch, bits):
    model = build_model(arch, "nano").half()
    if bits < 16:
        apply_bitmap(model, [bits] * model.config.num_hidden_layers, group_size=32)
    layer = decoder_layers(model)[0]
    stored = sum(t.nbytes for t in layer.parameters()) + sum(
        t.nbytes for t in layer.buffers() if t is not None
    )
    # rotary caches are not weights
    stored -= sum(b.nbytes for n, b in layer.named_buffers() if "rotary" in n or "inv_freq" in n)
    assert stored == decoder_layer_weight_bytes(model.config, bits, group_size=32)


def test_non_layer_bytes_match_model():
    for arch in ("llama", "opt", "gpt2"):
        model = build_model(arch, "nano")
        layer_ids = {id(p) for p in decoder_layers(model).parameters()}
        n = sum(p.numel() for p in model.parameters() if id(p) not in layer_ids)
        assert non_layer_weight_bytes(model.config) == 2 * n, arch


def test_shapes_gqa_and_families():
    llama = LlamaConfig(
        hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336
    )
    shapes = dict((n, (i, o)) for n, i, o in layer_linear_shapes(llama))
    assert shapes["self_attn.k_proj"] == (4096, 1024) and shapes["mlp.down_proj"] == (14336, 4096)
    opt13 = OPTConfig(hidden_size=5120, num_hidden_layers=40, ffn_dim=20480, num_attention_heads=40)
    n_params = (
        4 * 5120 * 5120 + 2 * 5120 * 20480 + 4 * 5120 + 5120 + 20480 + 4 * 5120
    )  # weights + biases + 2 LNs
    assert decoder_layer_weight_bytes(opt13, 16) == 2 * n_params
    assert (
        decoder_layer_weight_bytes(opt13, 4)
        < decoder_layer_weight_bytes(opt13, 8)
        < decoder_layer_weight_bytes(opt13, 16)
    )
    qwen = Qwen2Config(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, intermediate_size=512)
    assert decoder_layer_weight_bytes(qwen, 16) > decoder_layer_weight_bytes(
        LlamaConfig(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, intermediate_size=512), 16
    )  # qkv biases
    assert len(layer_linear_shapes(GPT2Config(n_embd=64, n_head=4))) == 4


def test_kv_bytes_match_stored():
    cfg = LlamaConfig(hidden_size=256, num_attention_heads=8, num_key_value_heads=4, intermediate_size=512)
    tokens = 5
    x = torch.randn(1, 4, tokens, 32)
    assert kv_bytes_per_token(cfg, 16) == 2 * x.to(torch.float16).nbytes // tokens
    for bits in (8, 4):
        q, s = quantize_kv(x, bits, axis=-1)
        assert kv_bytes_per_token(cfg, bits) == 2 * kv_stored_bytes(q, s) // tokens
    assert kv_bytes_per_token(cfg, 4) < kv_bytes_per_token(cfg, 8) < kv_bytes_per_token(cfg, 16)
    with pytest.raises(ValueError):
        kv_bytes_per_token(cfg, 3)


def test_bitmap_bytes_mixed():
    model = build_model("llama", "nano")
    cfg = model.config
    per_layer = [decoder_layer_weight_bytes(cfg, b, 128) for b in (3, 8)]
    assert bitmap_weight_bytes(cfg, [3, 8]) == sum(per_layer)
    with pytest.raises(ValueError, match="decoder layers"):
        bitmap_weight_bytes(cfg, [3, 8, 4])
    with pytest.raises(ValueError, match="unknown operator"):
        bitmap_weight_bytes(cfg, {0: {"mlp.nope": 4}})
