"""KV-cache quantization: symmetric int8 (or packed int4) codes with fp16 scales.

``quantize_kv(x, bits, axis)`` shares one scale along ``axis`` (an int or a tuple of ints). On
``(batch, kv_heads, seq, head_dim)`` tensors, ``axis=-1`` gives one scale per token and head
(the layout :func:`quant.accounting.kv_bytes_per_token` counts), ``axis=(-2, -1)`` one per head
over a block of tokens, ``axis=-2`` one per channel (KIVI-style keys). 8-bit codes are ``int8``;
4-bit codes are two per ``uint8`` along the last dimension (which must then be even). The
dtype of ``q`` tells :func:`dequantize_kv` which it is.
"""

from __future__ import annotations

import torch

MIN_SCALE = 2.0**-14


def _qmax(bits: int) -> int:
    if bits not in (4, 8):
        raise ValueError(f"KV quantization supports 4 or 8 bits, not {bits!r}")
    return (1 << (bits - 1)) - 1


def quantize_kv(
    x: torch.Tensor, bits: int = 8, axis: int | tuple[int, ...] = -1
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scale)``: ``x ≈ codes * scale`` with ``scale`` (fp16, keepdim) shared along ``axis``."""
    qmax = _qmax(bits)
    dims = (axis,) if isinstance(axis, int) else tuple(axis)
    xf = x.detach().to(torch.float32)
    scale = (xf.abs().amax(dim=dims, keepdim=True) / qmax).clamp(min=MIN_SCALE).to(torch.float16)
    q = torch.clamp(torch.round(xf / scale.to(torch.float32)), -qmax, qmax).to(torch.int8)
    if bits == 8:
        return q, scale
    if x.shape[-1] % 2:
        raise ValueError(f"4-bit KV packing needs an even last dimension, got {x.shape[-1]}")
    u = (q + 8).to(torch.uint8)  # 1..15
    packed = u[..., 0::2] | (u[..., 1::2] << 4)
    return packed.contiguous(), scale


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """Inverse of :func:`quantize_kv` (``int8`` codes: 8-bit; ``uint8``: packed 4-bit)."""
    if q.dtype == torch.int8:
        codes = q.to(torch.float32)
    elif q.dtype == torch.uint8:
        lo = (q & 0x0F).to(torch.float32) - 8
        hi = (q >> 4).to(torch.float32) - 8
        codes = torch.stack((lo, hi), dim=-1).reshape(*q.shape[:-1], q.shape[-1] * 2)
    else:
        raise TypeError(f"KV codes must be int8 (8-bit) or uint8 (packed 4-bit), not {q.dtype}")
    return (codes * scale.to(torch.float32)).to(dtype)


def fake_quantize_kv(x: torch.Tensor, bits: int = 8, axis: int | tuple[int, ...] = -1) -> torch.Tensor:
    """Quantize and dequantize back to ``x``'s dtype (for quality checks)."""
    q, s = quantize_kv(x, bits, axis)
    return dequantize_kv(q, s, x.dtype)


def kv_stored_bytes(q: torch.Tensor, scale: torch.Tensor) -> int:
    """``nbytes`` actually stored for one quantized K or V tensor."""
    return q.nbytes + scale.nbytes
