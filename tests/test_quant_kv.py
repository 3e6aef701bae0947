"""KV-cache quantization: round trip error, layouts, packing."""

from __future__ import annotations

import pytest
import torch

from quant.kv import dequantize_kv, fake_quantize_kv, quantize_kv


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("axis", [-1, -2, (-2, -1)])
def test_kv_roundtrip_error_bound(bits, axis):
    x = torch.randn(2, 4, 9, 16, dtype=torch.float16) * 3
    q, s = quantize_kv(x, bits, axis)
    assert q.dtype == (torch.int8 if bits == 8 else torch.uint8)
    if bits == 4:
        assert q.shape[-1] == 8
    y = dequantize_kv(q, s, torch.float32)
    assert y.shape == x.shape
    assert torch.all((y - x.float()).abs() <= s.float() / 2 + 1e-3)


def test_per_token_scale_shape_and_int8_quality():
    x = torch.randn(1, 2, 5, 32)
    q, s = quantize_kv(x, 8, axis=-1)
    assert s.shape == (1, 2, 5, 1) and s.dtype == torch.float16
    rel = (fake_quantize_kv(x, 8) - x).norm() / x.norm()
    assert rel < 0.01
    assert (fake_quantize_kv(x, 4) - x).norm() / x.norm() > rel


def test_kv_bad_input():
    with pytest.raises(ValueError, match="4 or 8"):
        quantize_kv(torch.randn(2, 4), bits=3)
    with pytest.raises(ValueError, match="even"):
        quantize_kv(torch.randn(2, 5), bits=4)
    with pytest.raises(TypeError):
        dequantize_kv(torch.zeros(2, dtype=torch.int32), torch.ones(1))
