"""Apply a per-layer (optionally per-operator) bit map to a Hugging Face decoder model.

A bit map gives each decoder layer a bit width (16 keeps the layer unquantized), either as a
list/dict ``{layer: bits}`` or, for finer control, ``{layer: {op_name: bits}}`` with operator
names from :func:`quant.accounting.layer_linear_shapes` (e.g. ``"mlp.down_proj"``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from quant.accounting import (
    ALL_BITS,
    check_bits,
    layer_linear_biases,
    layer_linear_shapes,
    layer_norm_bytes,
    packed_linear_bytes,
)
from quant.linear import QuantLinear

log = logging.getLogger(__name__)

LayerBits = int | Mapping[str, int]
BitMap = Sequence[LayerBits] | Mapping[int, LayerBits]


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The ``ModuleList`` of decoder layers (Llama-like ``model.layers``, OPT ``decoder.layers``, GPT-2 ``h``)."""
    for path in ("model.layers", "model.decoder.layers", "transformer.h", "layers", "decoder.layers", "h"):
        obj: Any = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, nn.ModuleList):
            return obj
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")


def normalize_bitmap(bit_map: BitMap, config: Any, num_layers: int) -> dict[int, dict[str, int]]:
    """``{layer: {op: bits}}`` for every layer and operator; checks layer indices, op names and bit widths."""
    ops = [n for n, _, _ in layer_linear_shapes(config)]
    items = dict(enumerate(bit_map)) if isinstance(bit_map, Sequence) else dict(bit_map)
    if isinstance(bit_map, Sequence) and len(items) != num_layers:
        raise ValueError(f"bit map has {len(items)} entries but the model has {num_layers} decoder layers")
    out: dict[int, dict[str, int]] = {i: dict.fromkeys(ops, 16) for i in range(num_layers)}
    for key, val in items.items():
        i = int(key)
        if not 0 <= i < num_layers:
            raise ValueError(f"bit map names layer {key!r}; the model has layers 0..{num_layers - 1}")
        if isinstance(val, Mapping):
            for op, b in val.items():
                if op not in out[i]:
                    raise ValueError(f"unknown operator {op!r} in layer {i}; known: {', '.join(ops)}")
                check_bits(int(b))
                out[i][op] = int(b)
        else:
            check_bits(int(val))
            out[i] = dict.fromkeys(ops, int(val))
    return out


def bitmap_weight_bytes(
    config: Any, bit_map: BitMap, group_size: int | None = 128, symmetric: bool = True
) -> int:
    """Bytes of all decoder layers under ``bit_map`` (codes, scales, zeros, fp16 biases and norms)."""
    norm = normalize_bitmap(bit_map, config, config.num_hidden_layers)
    shapes = {n: (i, o) for n, i, o in layer_linear_shapes(config)}
    biases = layer_linear_biases(config)
    total = 0
    for ops in norm.values():
        total += layer_norm_bytes(config)
        for op, b in ops.items():
            i, o = shapes[op]
            total += packed_linear_bytes(i, o, b, group_size, symmetric, biases[op])
    return total


def apply_bitmap(
    model: nn.Module, bit_map: BitMap, group_size: int | None = 128, symmetric: bool = True
) -> nn.Module:
    """Replace the linear operators of each decoder layer by :class:`QuantLinear` at its bits (in place)."""
    layers = decoder_layers(model)
    norm = normalize_bitmap(bit_map, model.config, len(layers))
    counts = dict.fromkeys(ALL_BITS, 0)
    for i, ops in norm.items():
        for op, b in ops.items():
            counts[b] += 1
            if b == 16:
                continue
            parent_name, _, leaf = op.rpartition(".")
            parent = layers[i].get_submodule(parent_name) if parent_name else layers[i]
            old = getattr(parent, leaf)
            if isinstance(old, QuantLinear):
                raise ValueError(f"layer {i} {op} is already quantized")
            setattr(parent, leaf, QuantLinear.from_module(old, b, group_size, symmetric))
    log.info(
        "quantized %d decoder layers: %s operators per bit width (group=%s, %s)",
        len(layers),
        {b: c for b, c in counts.items() if c},
        group_size,
        "symmetric" if symmetric else "asymmetric",
    )
    return model


def keep_dequantized(model: nn.Module) -> int:
    """Let every :class:`QuantLinear` of ``model`` keep its dequantized weight after its first call (the
    same outputs, faster, more memory: for a CPU that emulates a device by a cost model, where only
    the tokens, not this compute's time, matter); returns how many layers it set."""
    n = 0
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.cache_dequantized = True
            n += 1
    return n
