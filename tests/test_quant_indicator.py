"""The variance indicator: formula vs Monte-Carlo, monotonicity, hooks on real text, file format."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import OPTConfig

from localmodels import build_model
from quant.indicator import (
    collect_input_moments,
    load_indicator,
    op_omega,
    save_indicator,
    synthetic_indicator,
    variance_indicator,
)
from quant.rtn import fake_quantize


@pytest.mark.parametrize("bits", [3, 4, 8])
@pytest.mark.parametrize("group_size", [None, 64])
def test_monte_carlo_output_variance_matches_formula(bits, group_size):
    g = torch.Generator().manual_seed(bits)
    w = torch.randn(128, 256, generator=g, dtype=torch.float64).float() * 0.05
    sigma = 1.7
    x = torch.randn(4096, 256, generator=g) * sigma
    e = (fake_quantize(w, bits, group_size) - w).double()
    added = (x.double() @ e.T).pow(2).sum(-1).mean()  # output noise power per token
    predicted = op_omega(w, float(x.double().pow(2).mean()), bits, group_size)
    assert abs(float(added) / predicted - 1) < 0.10


def test_bound_model_is_three_times_uniform():
    w = torch.randn(32, 64)
    assert op_omega(w, 1.0, 4, error_model="bound") == pytest.approx(3 * op_omega(w, 1.0, 4))
    with pytest.raises(ValueError, match="error model"):
        op_omega(w, 1.0, 4, error_model="nope")


@pytest.fixture(scope="module")
def measured(data_root):
    from localmodels import default_tokenizer
    from quant.evaluate import calibration_blocks

    tok = default_tokenizer()
    model = build_model("llama", "nano", tokenizer=tok)
    calib = calibration_blocks(tok, tokens=256, seq_len=64, root=data_root)
    moments = collect_input_moments(model, calib.split(2))
    return model, moments, calib


def test_hooks_collect_every_operator(measured):
    model, moments, calib = measured
    assert calib.numel() >= 256
    assert len(moments) == 2 * 7
    assert all(v > 0 for v in moments.values())
    assert not any(h for m in model.modules() for h in m._forward_pre_hooks.values())  # hooks removed


def test_omega_strictly_decreasing_in_bits(measured, tmp_path):
    model, moments, _ = measured
    omega, per_op = variance_indicator(model, moments, (2, 3, 4, 8, 16))
    for i, v in omega.items():
        vals = [v[b] for b in (2, 3, 4, 8, 16)]
        assert all(a > b for a, b in zip(vals, vals[1:], strict=False)), (i, vals)
        assert sum(o[3] for o in per_op[i].values()) == pytest.approx(v[3])
    path = tmp_path / "omega.json"
    save_indicator(path, omega, {"model": "nano", "calib_tokens": 256})
    doc = json.loads(path.read_text())
    assert doc["model"] == "nano" and doc["bits"] == [2, 3, 4, 8, 16] and set(doc["omega"]) == {"0", "1"}
    back, meta = load_indicator(path)
    assert back.keys() == omega.keys() and meta["calib_tokens"] == 256
    for i in omega:
        assert back[i] == pytest.approx(omega[i])


def test_load_indicator_rejects_garbage(tmp_path):
    p = tmp_path / "x.json"
    p.write_text("{nope")
    with pytest.raises(ValueError, match="not a valid indicator"):
        load_indicator(p)
    p.write_text('{"a": 1}')
    with pytest.raises(ValueError, match="no 'omega'"):
        load_indicator(p)


def test_synthetic_indicator_for_opt13b():
    cfg = OPTConfig(hidden_size=5120, num_hidden_layers=40, ffn_dim=20480, num_attention_heads=40)
    om = synthetic_indicator(cfg, [3, 4, 8, 16], seed=1)
    assert len(om) == 40
    assert all(v[3] > v[4] > v[8] > v[16] == 0 for v in om.values())
    assert len({round(v[4], 6) for v in om.values()}) > 30  # varies by layer
    assert synthetic_indicator(cfg, [4], seed=1) == {i: {4: v[4]} for i, v in om.items()}
    assert synthetic_indicator(cfg, [4], seed=2) != synthetic_indicator(cfg, [4], seed=1)
