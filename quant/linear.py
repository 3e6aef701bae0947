"""``QuantLinear``: a linear layer that stores packed RTN codes, fp16 scales (and zeros) and
dequantizes on the fly (dequantize + ``F.linear``). For 8-bit symmetric per-channel weights it
uses torch's int8 weight-only matmul kernel (``torch._weight_int8pack_mm``) when the device has one.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from quant.packing import pack, unpack
from quant.rtn import dequantize_rtn, quantize_rtn

log = logging.getLogger(__name__)


def _conv1d_type():
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover - transformers always has it today
        return None
    return Conv1D


def linear_weight(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(weight (out, in), bias)`` of an ``nn.Linear`` or a GPT-2 ``Conv1D``."""
    conv1d = _conv1d_type()
    if isinstance(module, nn.Linear):
        return module.weight, module.bias
    if conv1d is not None and isinstance(module, conv1d):
        return module.weight.t(), module.bias
    raise TypeError(f"cannot quantize {type(module).__name__}; expected nn.Linear or Conv1D")


class QuantLinear(nn.Module):
    """Weight-only quantized linear layer (``bits`` in 2, 3, 4, 8)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bits: int,
        group_size: int | None = 128,
        symmetric: bool = True,
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group_size, self.symmetric = bits, group_size, symmetric
        self.register_buffer("qweight", torch.empty(0, dtype=torch.uint8))
        self.register_buffer("scales", torch.empty(0, dtype=torch.float16))
        self.register_buffer("zeros", None if symmetric else torch.empty(0, dtype=torch.uint8))
        self.register_buffer("bias", torch.empty(0, dtype=torch.float16) if bias else None)
        self.use_kernel = True
        # keep the dequantized weight after the first call (:func:`quant.apply.keep_dequantized`): the
        # same tokens, faster on a CPU that only emulates a device, whose time a cost model gives
        self.cache_dequantized = False
        self._dequantized: torch.Tensor | None = None  # not a buffer: not what the layer stores

    @classmethod
    def from_module(
        cls, module: nn.Module, bits: int, group_size: int | None = 128, symmetric: bool = True
    ) -> QuantLinear:
        weight, bias = linear_weight(module)
        out_f, in_f = weight.shape
        q = cls(in_f, out_f, bits, group_size, symmetric, bias=bias is not None)
        r = quantize_rtn(weight, bits, group_size, symmetric)
        dev = weight.device
        q.qweight = pack(r.codes, bits).to(dev)
        q.scales = r.scales.to(dev)
        if r.zeros is not None:
            q.zeros = r.zeros.to(dev)
        if bias is not None:
            q.bias = bias.detach().to(torch.float16).clone()
        return q

    def codes(self) -> torch.Tensor:
        return unpack(self.qweight, self.bits, self.in_features)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The ``(out, in)`` weight this layer computes with."""
        return dequantize_rtn(self.codes(), self.scales, self.zeros, self.bits, self.group_size, dtype)

    def stored_bytes(self) -> int:
        """``nbytes`` of everything stored (equals :func:`quant.accounting.packed_linear_bytes`)."""
        return sum(b.nbytes for b in self.buffers())

    def _int8_kernel(self, x: torch.Tensor) -> torch.Tensor | None:
        if not (self.use_kernel and self.bits == 8 and self.symmetric and self.group_size is None):
            return None
        if not hasattr(torch, "_weight_int8pack_mm") or x.dtype not in (
            torch.float32,
            torch.float16,
            torch.bfloat16,
        ):
            return None
        w8 = torch.bitwise_xor(self.qweight, 0x80).view(torch.int8)  # code = q + 128  ->  q
        x2 = x.reshape(-1, self.in_features).contiguous()
        try:
            y = torch._weight_int8pack_mm(x2, w8, self.scales.reshape(-1).to(x.dtype))
        except (RuntimeError, NotImplementedError) as e:  # kernel missing for this device/dtype
            log.debug("int8 weight kernel unavailable (%s); falling back to dequantize + matmul", e)
            self.use_kernel = False
            return None
        return y.reshape(*x.shape[:-1], self.out_features)

    def _weight(self, dtype: torch.dtype) -> torch.Tensor:
        if not self.cache_dequantized:
            return self.dequantize(dtype)
        if self._dequantized is None or self._dequantized.dtype != dtype:
            self._dequantized = self.dequantize(dtype)
        return self._dequantized

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = None if self.cache_dequantized else self._int8_kernel(x)
        if y is None:
            y = F.linear(x, self._weight(x.dtype))
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    def extra_repr(self) -> str:
        g = "channel" if self.group_size is None else f"group={self.group_size}"
        sym = "sym" if self.symmetric else "asym"
        return f"in={self.in_features}, out={self.out_features}, bits={self.bits}, {g}, {sym}"
