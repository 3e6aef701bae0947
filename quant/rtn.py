"""Round-to-nearest (RTN) weight quantization: symmetric or asymmetric, per channel or per group.

Codes are unsigned integers in ``[0, 2**bits)``. Symmetric: ``code = round(w / s) + 2**(bits-1)``
with ``s = max|w| / (2**(bits-1) - 1)`` (no zero point stored). Asymmetric:
``code = round(w / s) + z`` with ``s = (max(w, 0) - min(w, 0)) / (2**bits - 1)`` and a uint8
zero point ``z``. Scales are stored in fp16, rounded *up* so that no weight is clipped:
every weight is then within ``s / 2`` of its dequantized value (the RTN guarantee).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quant.accounting import QUANT_BITS, max_code

MIN_SCALE = 2.0**-14  # smallest normal fp16; keeps all-zero groups finite


@dataclass
class RTNWeight:
    """Unpacked result of :func:`quantize_rtn` for a ``(out_features, in_features)`` weight."""

    codes: torch.Tensor  # uint8 (out, in)
    scales: torch.Tensor  # fp16 (out, groups)
    zeros: torch.Tensor | None  # uint8 (out, groups), None when symmetric
    bits: int
    group_size: int | None

    @property
    def symmetric(self) -> bool:
        return self.zeros is None


def _check(bits: int, group_size: int | None) -> None:
    if bits not in QUANT_BITS:
        raise ValueError(f"RTN supports {QUANT_BITS} bits, not {bits!r}")
    if group_size is not None and (not isinstance(group_size, int) or group_size <= 0):
        raise ValueError(f"group_size must be a positive integer or None, not {group_size!r}")


def _grouped(w: torch.Tensor, group_size: int | None) -> torch.Tensor:
    """``(out, in)`` -> ``(out, groups, group)``, zero-padding the last group."""
    out_f, in_f = w.shape
    gs = in_f if group_size is None else min(group_size, in_f)
    pad = (-in_f) % gs
    if pad:
        w = torch.nn.functional.pad(w, (0, pad))
    return w.reshape(out_f, -1, gs)


def _fp16_up(s: torch.Tensor) -> torch.Tensor:
    """Round positive fp32 scales to fp16, never below the fp32 value."""
    s = s.clamp(min=MIN_SCALE)
    s16 = s.to(torch.float16)
    low = s16.to(torch.float32) < s
    if low.any():
        up = torch.nextafter(
            s16.to(torch.float32)[low].to(torch.float16), torch.tensor(float("inf"), dtype=torch.float16)
        )
        s16[low] = up
    return s16


def quantize_rtn(
    weight: torch.Tensor, bits: int, group_size: int | None = 128, symmetric: bool = True
) -> RTNWeight:
    """Quantize a 2-D weight ``(out_features, in_features)`` by round-to-nearest."""
    _check(bits, group_size)
    if weight.dim() != 2:
        raise ValueError(f"expected a 2-D weight, got shape {tuple(weight.shape)}")
    out_f, in_f = weight.shape
    w = _grouped(weight.detach().to(torch.float32), group_size)
    qmax = max_code(bits, symmetric)
    if symmetric:
        s16 = _fp16_up(w.abs().amax(-1) / qmax)
        s = s16.to(torch.float32).unsqueeze(-1)
        q = torch.clamp(torch.round(w / s), -qmax, qmax) + (1 << (bits - 1))
        zeros = None
    else:
        lo = w.amin(-1).clamp(max=0.0)
        hi = w.amax(-1).clamp(min=0.0)
        s16 = _fp16_up((hi - lo) / qmax)
        s = s16.to(torch.float32)
        z = torch.clamp(torch.round(-lo / s), 0, qmax)
        q = torch.clamp(torch.round(w / s.unsqueeze(-1)) + z.unsqueeze(-1), 0, qmax)
        zeros = z.to(torch.uint8)
    codes = q.to(torch.uint8).reshape(out_f, -1)[:, :in_f].contiguous()
    return RTNWeight(codes, s16, zeros, bits, group_size)


def dequantize_rtn(
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bits: int,
    group_size: int | None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Rebuild the ``(out, in)`` weight from unpacked codes, fp16 scales and optional zero points."""
    out_f, in_f = codes.shape
    g = _grouped(codes.to(torch.float32), group_size)
    zero = (
        torch.tensor(float(1 << (bits - 1)), device=codes.device)
        if zeros is None
        else zeros.to(torch.float32).unsqueeze(-1)
    )
    w = (g - zero) * scales.to(torch.float32).unsqueeze(-1)
    return w.reshape(out_f, -1)[:, :in_f].to(dtype)


def fake_quantize(
    weight: torch.Tensor, bits: int, group_size: int | None = 128, symmetric: bool = True
) -> torch.Tensor:
    """Quantize then dequantize (same shape and dtype as ``weight``)."""
    r = quantize_rtn(weight, bits, group_size, symmetric)
    return dequantize_rtn(r.codes, r.scales, r.zeros, bits, group_size, weight.dtype)


def scale_of(r: RTNWeight) -> torch.Tensor:
    """Per-element scale ``S`` broadcast to the weight's ``(out, in)`` shape (for error bounds)."""
    out_f, in_f = r.codes.shape
    gs = in_f if r.group_size is None else min(r.group_size, in_f)
    return r.scales.to(torch.float32).repeat_interleave(gs, dim=1)[:, :in_f]
