"""Exact memory accounting for quantized weights and the KV cache (pure arithmetic, no torch).

The byte counts here are the ``nbytes`` of what :class:`quant.linear.QuantLinear` and
:mod:`quant.kv` really store, so the planner's memory model and the running engine agree:

* packed weight codes: each output row holds ``in_features`` codes of ``bits`` bits, packed in
  blocks of 8 codes into ``bits`` bytes (``ceil(in_features / 8) * bits`` bytes per row; 8-bit
  codes are one byte each, unpadded);
* scales: one fp16 per (output row, group); ``group_size=None`` means one group per row;
* zero points (asymmetric only): one uint8 per (output row, group);
* bias: fp16, ``out_features`` values;
* ``bits=16`` means an unquantized fp16 weight (2 bytes per element).

Decoder-layer shapes are read from Hugging Face configs: Llama / Mistral / Qwen2 (GQA and a
gated MLP), OPT and GPT-2.
"""

from __future__ import annotations

import math
from typing import Any

QUANT_BITS = (2, 3, 4, 8)
ALL_BITS = (2, 3, 4, 8, 16)
KV_BITS = (4, 8, 16)
FP16_BYTES = 2
ZERO_BYTES = 1  # asymmetric zero points are stored as uint8


def check_bits(bits: int) -> None:
    if bits not in ALL_BITS:
        raise ValueError(
            f"unsupported weight bit width {bits!r}; choose one of {', '.join(map(str, ALL_BITS))}"
        )


def num_groups(in_features: int, group_size: int | None) -> int:
    """Groups per output row: ``ceil(in_features / group_size)``; 1 for per-channel (``None``)."""
    if group_size is None:
        return 1
    if group_size <= 0:
        raise ValueError(f"group_size must be a positive integer or None, not {group_size!r}")
    return math.ceil(in_features / group_size)


def packed_row_bytes(n_codes: int, bits: int) -> int:
    """Bytes of ``n_codes`` codes of ``bits`` bits: one byte each at 8 bits, else blocks of 8 codes in ``bits`` bytes."""
    if bits == 8:
        return n_codes
    return math.ceil(n_codes / 8) * bits


def packed_linear_bytes(
    in_features: int,
    out_features: int,
    bits: int,
    group_size: int | None = 128,
    symmetric: bool = True,
    bias: bool = False,
) -> int:
    """Bytes stored for one linear operator at ``bits`` (16 = fp16 weight): codes + scales + zeros + bias."""
    check_bits(bits)
    if in_features <= 0 or out_features <= 0:
        raise ValueError(f"linear shape must be positive, got in={in_features}, out={out_features}")
    bias_bytes = out_features * FP16_BYTES if bias else 0
    if bits == 16:
        return in_features * out_features * FP16_BYTES + bias_bytes
    groups = num_groups(in_features, group_size)
    codes = out_features * packed_row_bytes(in_features, bits)
    scales = out_features * groups * FP16_BYTES
    zeros = 0 if symmetric else out_features * groups * ZERO_BYTES
    return codes + scales + zeros + bias_bytes


def max_code(bits: int, symmetric: bool) -> int:
    """The largest code of ``bits``-bit round-to-nearest (symmetric: one sign bit)."""
    return (1 << (bits - 1)) - 1 if symmetric else (1 << bits) - 1


def model_family(config: Any) -> str:
    """``"llama"`` (Llama/Mistral/Qwen2-like, gated MLP), ``"opt"`` or ``"gpt2"``."""
    mt = getattr(config, "model_type", "")
    if mt == "opt":
        return "opt"
    if mt == "gpt2":
        return "gpt2"
    if hasattr(config, "intermediate_size") and hasattr(config, "num_attention_heads"):
        return "llama"
    raise ValueError(
        f"unsupported model config {type(config).__name__} (model_type={mt!r}); "
        "expected Llama/Mistral/Qwen2, OPT or GPT-2"
    )


def head_dim(config: Any) -> int:
    fam = model_family(config)
    hidden = config.n_embd if fam == "gpt2" else config.hidden_size
    heads = config.n_head if fam == "gpt2" else config.num_attention_heads
    hd = getattr(config, "head_dim", None) if fam == "llama" else None
    return int(hd) if hd else hidden // heads


def num_kv_heads(config: Any) -> int:
    fam = model_family(config)
    if fam == "gpt2":
        return int(config.n_head)
    if fam == "llama":
        return int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    return int(config.num_attention_heads)


def _linear_specs(config: Any) -> list[tuple[str, int, int, bool]]:
    """(name, in_features, out_features, has_bias) of each linear operator of one decoder layer."""
    fam = model_family(config)
    if fam == "gpt2":
        h = config.n_embd
        inner = config.n_inner or 4 * h
        return [
            ("attn.c_attn", h, 3 * h, True),
            ("attn.c_proj", h, h, True),
            ("mlp.c_fc", h, inner, True),
            ("mlp.c_proj", inner, h, True),
        ]
    if fam == "opt":
        h = config.hidden_size
        ffn = config.ffn_dim
        b = bool(getattr(config, "enable_bias", True))
        return [
            ("self_attn.q_proj", h, h, b),
            ("self_attn.k_proj", h, h, b),
            ("self_attn.v_proj", h, h, b),
            ("self_attn.out_proj", h, h, b),
            ("fc1", h, ffn, b),
            ("fc2", ffn, h, b),
        ]
    h = config.hidden_size
    hd = head_dim(config)
    q_out = config.num_attention_heads * hd
    kv_out = num_kv_heads(config) * hd
    inter = config.intermediate_size
    if getattr(config, "model_type", "") == "qwen2":
        qkv_bias, o_bias = True, False
    else:
        qkv_bias = o_bias = bool(getattr(config, "attention_bias", False))
    mlp_bias = bool(getattr(config, "mlp_bias", False))
    return [
        ("self_attn.q_proj", h, q_out, qkv_bias),
        ("self_attn.k_proj", h, kv_out, qkv_bias),
        ("self_attn.v_proj", h, kv_out, qkv_bias),
        ("self_attn.o_proj", q_out, h, o_bias),
        ("mlp.gate_proj", h, inter, mlp_bias),
        ("mlp.up_proj", h, inter, mlp_bias),
        ("mlp.down_proj", inter, h, mlp_bias),
    ]


def layer_linear_shapes(config: Any) -> list[tuple[str, int, int]]:
    """``(name, in_features, out_features)`` of each linear operator of one decoder layer (names relative to the layer)."""
    return [(n, i, o) for n, i, o, _ in _linear_specs(config)]


def layer_linear_biases(config: Any) -> dict[str, bool]:
    """Whether each linear operator of one decoder layer has a bias."""
    return {n: b for n, _, _, b in _linear_specs(config)}


def layer_norm_bytes(config: Any) -> int:
    """fp16 bytes of one decoder layer's norms (RMSNorm: weight; LayerNorm: weight + bias)."""
    fam = model_family(config)
    if fam == "llama":
        return 2 * config.hidden_size * FP16_BYTES
    h = config.n_embd if fam == "gpt2" else config.hidden_size
    return 2 * 2 * h * FP16_BYTES


def decoder_layer_weight_bytes(
    config: Any, bits: int, group_size: int | None = 128, symmetric: bool = True
) -> int:
    """Bytes of one decoder layer with every linear operator at ``bits``, plus its fp16 norms."""
    return sum(
        packed_linear_bytes(i, o, bits, group_size, symmetric, bias=b) for _, i, o, b in _linear_specs(config)
    ) + layer_norm_bytes(config)


def kv_bytes_per_token(config: Any, kv_bits: int = 16) -> int:
    """Bytes of K and V of one token in one layer.

    fp16 when ``kv_bits=16``; for 8 or 4 bits, symmetric codes (int8, or two 4-bit codes per
    byte) plus one fp16 scale per (token, KV head) for each of K and V, as :func:`quant.kv.quantize_kv`
    stores them with ``axis=-1`` on ``(batch, kv_heads, seq, head_dim)`` tensors.
    """
    if kv_bits not in KV_BITS:
        raise ValueError(f"unsupported KV bit width {kv_bits!r}; choose one of 4, 8, 16")
    heads, hd = num_kv_heads(config), head_dim(config)
    if kv_bits == 16:
        return 2 * heads * hd * FP16_BYTES
    per_head = math.ceil(hd * kv_bits / 8) + FP16_BYTES
    return 2 * heads * per_head


def non_layer_weight_bytes(config: Any) -> int:
    """fp16 bytes outside the decoder layers: token (and position) embeddings, final norm, untied LM head."""
    fam = model_family(config)
    vocab = config.vocab_size
    if fam == "gpt2":
        h = config.n_embd
        return (vocab * h + config.n_positions * h + 2 * h) * FP16_BYTES
    h = config.hidden_size
    total = vocab * h
    if fam == "opt":
        proj = getattr(config, "word_embed_proj_dim", h) or h
        total = vocab * proj + (config.max_position_embeddings + 2) * h
        if proj != h:
            total += 2 * proj * h
        if getattr(config, "do_layer_norm_before", True) and not getattr(
            config, "_remove_final_layer_norm", False
        ):
            total += 2 * h
        if not getattr(config, "tie_word_embeddings", True):
            total += vocab * proj
        return total * FP16_BYTES
    total += h  # final RMSNorm
    if not getattr(config, "tie_word_embeddings", False):
        total += vocab * h
    return total * FP16_BYTES
