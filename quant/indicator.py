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

import logging
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from quant.accounting import layer_linear_shapes
from quant.apply import decoder_layers
from quant.linear import QuantLinear, linear_weight
from quant.omega import (  # noqa: F401  (the indicator's file and the synthetic one: known from here too)
    DEFAULT_BITS,
    ERROR_MODELS,
    Omega,
    load_indicator,
    save_indicator,
    synthetic_indicator,
)
from quant.rtn import quantize_rtn, scale_of

log = logging.getLogger(__name__)

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
