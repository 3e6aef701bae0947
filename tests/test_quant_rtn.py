"""Round-to-nearest quantizers, packing and the quantized linear module."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from localmodels import build_model
from quant.apply import apply_bitmap, decoder_layers
from quant.linear import QuantLinear
from quant.packing import pack, unpack
from quant.rtn import dequantize_rtn, quantize_rtn, scale_of


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("group_size", [None, 16, 128])
@pytest.mark.parametrize("symmetric", [True, False])
def test_rtn_error_within_half_scale(bits, group_size, symmetric):
    g = torch.Generator().manual_seed(bits * 7 + (group_size or 1))
    w = torch.randn(48, 200, generator=g) * torch.rand(48, 1, generator=g) * 3 + 0.2 * symmetric
    r = quantize_rtn(w, bits, group_size, symmetric)
    what = dequantize_rtn(r.codes, r.scales, r.zeros, bits, group_size)
    s = scale_of(r)
    assert int(r.codes.max()) < 2**bits
    assert torch.all((w - what).abs() <= s / 2 * (1 + 1e-5) + 1e-7)
    assert (w - what).abs().max() > 0  # it really quantized


@settings(max_examples=40, deadline=None)
@given(
    bits=st.sampled_from([2, 3, 4, 8]),
    rows=st.integers(1, 5),
    n=st.integers(1, 70),
    seed=st.integers(0, 2**31 - 1),
)
def test_pack_roundtrip(bits, rows, n, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (rows, n), generator=g, dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape[-1] == (n if bits == 8 else -(-n // 8) * bits)
    assert torch.equal(unpack(packed, bits, n), codes)


def test_pack_density():
    codes = torch.full((1, 16), 15, dtype=torch.uint8)
    assert pack(codes, 4).numel() == 8
    assert pack(codes % 8, 3).numel() == 6
    assert pack(codes % 4, 2).numel() == 4
    with pytest.raises(ValueError):
        pack(codes, 5)


def test_error_shrinks_with_bits():
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    errs = [float((w - dequantize_rtn(*_unpack(quantize_rtn(w, b)))).pow(2).mean()) for b in (2, 3, 4, 8)]
    assert errs == sorted(errs, reverse=True)


def _unpack(r):
    return r.codes, r.scales, r.zeros, r.bits, r.group_size


@pytest.mark.parametrize("bits", [3, 4, 8])
@pytest.mark.parametrize("group_size", [None, 32])
def test_quantlinear_matches_dequantized_matmul(bits, group_size):
    lin = torch.nn.Linear(96, 40)
    q = QuantLinear.from_module(lin, bits, group_size)
    x = torch.randn(2, 5, 96)
    ref = x @ q.dequantize().T + q.bias.float()
    assert torch.allclose(q(x), ref, atol=1e-4, rtol=1e-4)
    # and close to the original layer (8-bit: very close)
    tol = {3: 0.5, 4: 0.2, 8: 0.02}[bits]
    assert (q(x) - lin(x)).abs().max() < tol


def test_int8_kernel_path_equals_fallback():
    lin = torch.nn.Linear(64, 32, bias=False)
    q = QuantLinear.from_module(lin, 8, None)
    x = torch.randn(7, 64)
    fast = q(x)
    q.use_kernel = False
    assert torch.allclose(fast, q(x), atol=1e-4)


def test_apply_bitmap_llama_and_gpt2():
    for arch in ("llama", "gpt2", "opt"):
        model = build_model(arch, "nano")
        x = torch.randint(0, 100, (1, 12))
        ref = model(input_ids=x).logits
        apply_bitmap(model, {0: 8, 1: {next(iter(_first_op(model))): 4}}, group_size=32)
        layers = decoder_layers(model)
        assert sum(isinstance(m, QuantLinear) for m in layers[0].modules()) >= 4
        assert sum(isinstance(m, QuantLinear) for m in layers[1].modules()) == 1
        out = model(input_ids=x).logits
        assert out.shape == ref.shape and torch.isfinite(out).all()
        assert (out - ref).abs().max() < 0.5 * ref.abs().max()


def _first_op(model):
    from quant.accounting import layer_linear_shapes

    return [n for n, _, _ in layer_linear_shapes(model.config)][:1]


def test_bad_bitmap_messages():
    model = build_model("llama", "nano")
    with pytest.raises(ValueError, match="bit width"):
        apply_bitmap(model, [5, 8])
    with pytest.raises(ValueError, match="layers 0..1"):
        apply_bitmap(model, {7: 4})
