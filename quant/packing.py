"""Bit packing of integer codes along the last dimension (blocks of 8 codes -> ``bits`` bytes).

A row of ``n`` codes of ``bits`` bits (0 <= code < 2**bits) is padded to a multiple of 8 codes;
each block of 8 codes becomes one ``8 * bits``-bit little-endian integer split into ``bits``
bytes. So 4-bit codes take two per byte, 2-bit four per byte, 3-bit eight per three bytes,
8-bit one per byte. :func:`quant.accounting.packed_row_bytes` gives the same byte count.
"""

from __future__ import annotations

import torch

PACK_BITS = (2, 3, 4, 8)


def _check(bits: int) -> None:
    if bits not in PACK_BITS:
        raise ValueError(f"can pack only {PACK_BITS} bits, not {bits!r}")


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned integer ``codes`` (any integer dtype, values in ``[0, 2**bits)``) into uint8 along the last dim."""
    _check(bits)
    if codes.is_floating_point():
        raise TypeError("pack expects an integer tensor of codes")
    if bits == 8:
        return codes.to(torch.uint8).contiguous()
    n = codes.shape[-1]
    pad = (-n) % 8
    c = codes.to(torch.int64)
    if pad:
        c = torch.nn.functional.pad(c, (0, pad))
    c = c.reshape(*c.shape[:-1], -1, 8)
    shifts = torch.arange(8, device=c.device, dtype=torch.int64) * bits
    word = (c << shifts).sum(-1, keepdim=True)  # at most 32 bits for bits <= 4
    byte_shifts = torch.arange(bits, device=c.device, dtype=torch.int64) * 8
    out = (word >> byte_shifts) & 0xFF
    return out.reshape(*codes.shape[:-1], -1).to(torch.uint8).contiguous()


def unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack`: the first ``n`` codes of each row, as uint8."""
    _check(bits)
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack expects uint8, got {packed.dtype}")
    if bits == 8:
        return packed[..., :n]
    p = packed.to(torch.int64).reshape(*packed.shape[:-1], -1, bits)
    byte_shifts = torch.arange(bits, device=p.device, dtype=torch.int64) * 8
    word = (p << byte_shifts).sum(-1, keepdim=True)
    shifts = torch.arange(8, device=p.device, dtype=torch.int64) * bits
    codes = (word >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], -1)[..., :n].to(torch.uint8)
