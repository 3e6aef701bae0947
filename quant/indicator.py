"""Per-layer sensitivity indicator for mixed-precision planning (LLM-PQ's variance indicator).

For each decoder layer ``i`` and bit width ``b``::

    omega(i, b) = sum over the layer's linear operators W of  D_W * S_W(b)^2 * G(X)

``D_W`` is the number of weights, ``S_W(b)^2`` the mean squared RTN scale at ``b`` bits and
``G(X) = c * E[X^2]`` with ``X`` the operator's input activations from calibration text. It is
the expected power that rounding noise adds to the operator's outputs, per token.
``c = 1/12`` (``error_model="uniform"``, the default) is the variance of an error uniform on
``[-S/2, S/2]``, which is what RTN produces at 3 bits and up (the Monte-Carlo test checks this
within 10%); ``c = 1/4`` (``error_model="bound"``) is LLM-PQ's constant, the worst case ``(S/2)^2``.
The constant does not change any ranking. ``E[X^2]`` equals ``Var[X]`` for zero-mean inputs; the
second moment is used because the added noise ``E x`` scales with ``x``, not ``x - mean``.
``omega(i, 16) = 0``.

The file format (JSON) the planner reads::

    {"model": ..., "bits": [3, 4, 8, 16], "omega": {"<layer>": {"<bits>": float}}, "meta": {...}}
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from quant.accounting import layer_linear_shapes
from quant.apply import decoder_layers
from quant.linear import QuantLinear, linear_weight
from quant.rtn import max_code, quantize_rtn, scale_of

log = logging.getLogger(__name__)

ERROR_MODELS = {"uniform": 1.0 / 12.0, "bound": 1.0 / 4.0}
DEFAULT_BITS = (3, 4, 8, 16)

Omega = dict[int, dict[int, float]]
OpOmega = dict[int, dict[str, dict[int, float]]]


def _ops(model: nn.Module) -> list[tuple[int, str, nn.Module]]:
    layers = decoder_layers(model)
    names = [n for n, _, _ in layer_linear_shapes(model.config)]
    return [(i, n, layer.get_submodule(n)) for i, layer in enumerate(layers) for n in names]


@torch.no_grad()
def collect_input_moments(model: nn.Module, batches: Iterable[torch.Tensor]) -> dict[tuple[int, str], float]:
    """Mean of ``x^2`` over all elements of each linear operator's input, via forward pre-hooks."""
    sums: dict[tuple[int, str], float] = {}
    counts: dict[tuple[int, str], int] = {}
    handles = []

    def hook_for(key):
        def hook(_mod, args):
            x = args[0].detach().to(torch.float64)
            sums[key] = sums.get(key, 0.0) + float((x * x).sum())
            counts[key] = counts.get(key, 0) + x.numel()

        return hook

    for i, n, mod in _ops(model):
        handles.append(mod.register_forward_pre_hook(hook_for((i, n))))
    try:
        model.eval()
        tokens = 0
        for ids in batches:
            model(input_ids=ids)
            tokens += ids.numel()
    finally:
        for h in handles:
            h.remove()
    if not sums:
        raise ValueError("no calibration batches were given")
    log.info("collected input moments of %d operators from %d calibration tokens", len(sums), tokens)
    return {k: sums[k] / counts[k] for k in sums}


def op_omega(
    weight: torch.Tensor,
    second_moment: float,
    bits: int,
    group_size: int | None = 128,
    symmetric: bool = True,
    error_model: str = "uniform",
) -> float:
    """``D_W * mean(S^2) * c * E[X^2]`` for one operator (0 for 16 bits)."""
    if error_model not in ERROR_MODELS:
        raise ValueError(f"unknown error model {error_model!r}; choose one of {', '.join(ERROR_MODELS)}")
    if bits == 16:
        return 0.0
    r = quantize_rtn(weight, bits, group_size, symmetric)
    s2 = float((scale_of(r).to(torch.float64) ** 2).mean())
    return weight.numel() * s2 * ERROR_MODELS[error_model] * second_moment


def variance_indicator(
    model: nn.Module,
    moments: dict[tuple[int, str], float],
    bits_list: Sequence[int] = DEFAULT_BITS,
    group_size: int | None = 128,
    symmetric: bool = True,
    error_model: str = "uniform",
) -> tuple[Omega, OpOmega]:
    """``(omega per layer, omega per layer and operator)`` for every bit width in ``bits_list``."""
    per_op: OpOmega = {}
    for i, n, mod in _ops(model):
        if isinstance(mod, QuantLinear):
            raise ValueError("compute the indicator on the unquantized model")
        w, _ = linear_weight(mod)
        per_op.setdefault(i, {})[n] = {
            b: op_omega(w, moments[(i, n)], b, group_size, symmetric, error_model) for b in bits_list
        }
    omega = {i: {b: sum(v[b] for v in ops.values()) for b in bits_list} for i, ops in per_op.items()}
    return omega, per_op


def synthetic_indicator(
    config: Any,
    bits_list: Sequence[int] = DEFAULT_BITS,
    seed: int = 0,
    group_size: int | None = 128,
    symmetric: bool = True,
) -> Omega:
    """A *synthetic* (fabricated, plausible) omega for models too big to run here.

    Same formula, with ``D_W`` from the config's shapes, weights assumed Gaussian with std
    ``1/sqrt(in_features)`` (scale = expected max |w| of a group / max code) and an input second
    moment that grows with depth, is doubled for the first and last layers (commonly the most
    sensitive) and carries seeded log-normal noise. Not a measurement: for planner studies only.
    """
    rng = random.Random(seed)
    n_layers = int(config.num_hidden_layers)
    shapes = layer_linear_shapes(config)
    omega: Omega = {}
    for i in range(n_layers):
        depth = i / max(1, n_layers - 1)
        act = (1.0 + 2.0 * depth) * math.exp(rng.gauss(0.0, 0.3))
        if i in (0, n_layers - 1):
            act *= 2.0
        omega[i] = {}
        for b in bits_list:
            if b == 16:
                omega[i][b] = 0.0
                continue
            total = 0.0
            for _, fin, fout in shapes:
                gs = fin if group_size is None else min(group_size, fin)
                sigma = 1.0 / math.sqrt(fin)
                emax = sigma * math.sqrt(2.0 * math.log(2.0 * gs))  # ~ expected max |w| of gs Gaussians
                scale = (emax if symmetric else 2.0 * emax) / max_code(b, symmetric)
                total += fin * fout * scale**2 * ERROR_MODELS["uniform"] * act
            omega[i][b] = total
    return omega


def save_indicator(path: str | os.PathLike, omega: Omega, meta: dict) -> None:
    """Write omega as JSON: ``{"model", "bits", "omega": {"<layer>": {"<bits>": float}}, "meta"}``."""
    bits = sorted({b for v in omega.values() for b in v})
    doc = {
        "model": meta.get("model", "unknown"),
        "bits": bits,
        "omega": {str(i): {str(b): float(v[b]) for b in sorted(v)} for i, v in sorted(omega.items())},
        "meta": {k: v for k, v in meta.items() if k != "model"},
    }
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
    log.info("wrote the indicator of %d layers x %d bit widths to %s", len(omega), len(bits), path)


def load_indicator(path: str | os.PathLike) -> tuple[Omega, dict]:
    """Read a file written by :func:`save_indicator`: ``(omega {layer: {bits: value}}, meta)``."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not a valid indicator file ({e.msg})") from e
    if not isinstance(doc, dict) or "omega" not in doc:
        raise ValueError(f"{path}: not an indicator file (no 'omega' key)")
    omega = {int(i): {int(b): float(x) for b, x in v.items()} for i, v in doc["omega"].items()}
    meta = dict(doc.get("meta", {}))
    meta["model"] = doc.get("model", "unknown")
    meta["bits"] = doc.get("bits", sorted({b for v in omega.values() for b in v}))
    return omega, meta
