"""Catalog, cluster specs, memory and latency cost models, profiles."""

from __future__ import annotations

import json

import numpy as np
import pytest

from planner.catalog import CATALOG, device_type
from planner.cluster import ClusterSpecError, load_cluster
from planner.fidelity import memory_errors
from planner.latency import (
    Profile,
    decode_features,
    fit_linear,
    fit_profile,
    paper_ratio_check,
    prefill_features,
    roofline_profile,
)
from planner.memory import MemoryModel
from planner.modelshape import load_shape
from planner.profiler import profile_local


def test_catalog_has_required_devices():
    for name in ("T4", "P100-12G", "V100-32G", "A100-40G", "A800-80G", "L4", "A10", "H100"):
        assert name in CATALOG
    assert device_type("cpu").is_cpu and device_type("CPU").memory_bytes > 0
    with pytest.raises(ValueError, match="unknown device type"):
        device_type("Z80")


def test_cluster_yaml_and_shorthand(tmp_path):
    spec = tmp_path / "c.yaml"
    spec.write_text(
        "name: mixed\ninter_node_gbps: 50\nnodes:\n"
        "  - name: a\n    intra_node_gbps: 400\n    devices: [V100, {type: T4, count: 2}]\n"
        "  - name: b\n    devices: [A100]\n"
    )
    c = load_cluster(spec)
    assert [d.type.name for d in c.devices] == ["V100-32G", "T4", "T4", "A100-40G"]
    assert c.bandwidth_bytes_per_s(0, 1) == 400e9 / 8
    assert c.bandwidth_bytes_per_s(0, 3) == 50e9 / 8
    s = load_cluster("3xT4+V100")
    assert len(s.devices) == 4 and s.devices[3].node != s.devices[0].node
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"nodes": [{"devices": [{"type": "T4", "count": 0}]}]}))
    with pytest.raises(ClusterSpecError, match="count"):
        load_cluster(bad)
    with pytest.raises(ClusterSpecError, match="not found"):
        load_cluster(tmp_path / "missing.yaml")


def test_shipped_specs_load():
    from pathlib import Path

    specs = sorted((Path(__file__).parent.parent / "planner" / "specs").glob("*.yaml"))
    assert specs
    for p in specs:
        assert load_cluster(p).devices


def test_memory_model_matches_real_allocations():
    """Weights at mixed bit widths (quant.apply) and the real KV cache: predicted == actual bytes."""
    for name in ("llama:nano", "opt:nano"):
        shape = load_shape(name)
        err = memory_errors(shape, [16, 4][: shape.layers], batch=2, prompt_len=24, output_tokens=5)
        assert err["weights_error"] < 0.01 and err["kv_error"] < 0.01, err


def test_memory_model_gqa_and_kv_bits():
    gqa = load_shape("llama3-8b")
    m16 = MemoryModel(gqa, 8, 100, 28, kv_bits=16)
    m8 = MemoryModel(gqa, 8, 100, 28, kv_bits=8)
    # 8 KV heads of 128: 2 * 8 * 128 * 2 bytes per token per layer
    assert m16.layer_kv_bytes() == 8 * 128 * 2 * 8 * 128 * 2
    assert m8.layer_kv_bytes() < m16.layer_kv_bytes()
    assert m16.layer_weight_bytes(4) < m16.layer_weight_bytes(8) < m16.layer_weight_bytes(16)
    # tied OPT embeddings: the head costs nothing extra on a single stage, a copy on a separate last stage
    opt = MemoryModel(load_shape("opt-13b"), 1, 1, 1)
    assert opt.head_bytes(also_first=False) > opt.head_bytes(also_first=True)


def test_linear_fit_recovers_coefficients():
    true_p = np.array([1e-4, 2e-5, 3e-7, 4e-6, 5e-10])
    rows = [(v, s) for v in (1, 2, 4, 8) for s in (64, 128, 512, 1024)]
    coef = fit_linear(
        [prefill_features(v, s) for v, s in rows], [prefill_features(v, s) @ true_p for v, s in rows]
    )
    for v, s in ((3, 384), (7, 768)):
        assert prefill_features(v, s) @ coef == pytest.approx(prefill_features(v, s) @ true_p, rel=1e-6)
    true_d = np.array([2e-4, 1e-5, 1e-8, 1e-7])
    coef = fit_linear(
        [decode_features(v, c) for v, c in rows], [decode_features(v, c) @ true_d for v, c in rows]
    )
    assert decode_features(5, 384) @ coef == pytest.approx(decode_features(5, 384) @ true_d, rel=1e-6)


def test_roofline_reproduces_paper_ratios_and_orders_devices():
    shape = load_shape("opt-13b")
    r = paper_ratio_check(shape, device_type("P100"), device_type("V100"))
    assert r["prefill_ratio"] == pytest.approx(14.53, rel=0.05)
    assert r["decode_ratio"] == pytest.approx(7.29, rel=0.05)
    models = {
        n: fit_profile(roofline_profile(device_type(n), shape, [4, 16]))
        for n in ("T4", "V100", "A100", "H100")
    }
    dec = [models[n].decode_s(16, 8, 600) for n in ("T4", "V100", "A100", "H100")]
    assert dec == sorted(dec, reverse=True)
    # weight-only 4-bit decode is faster than fp16 where it is memory bound
    assert models["A100"].decode_s(4, 1, 600) < models["A100"].decode_s(16, 1, 600)


def test_profile_local_roundtrip(tmp_path):
    shape = load_shape("llama:nano")
    grid = [(v, s) for v in (1, 2, 4) for s in (16, 32, 64)]
    prof = profile_local(shape, "cpu", 1, grid, grid, reps=1, progress=False)
    assert prof.source == "measured" and len(prof.samples[16]["prefill"]) == 9
    assert all(t > 0 for *_, t in prof.samples[16]["decode"])
    path = tmp_path / "p.json"
    prof.save(path)
    back = Profile.load(path)
    lm = fit_profile(back)
    assert lm.prefill_s(16, 2, 32) > 0 and lm.decode_s(16, 2, 32) > 0
    path.write_text('{"version": 7}')
    with pytest.raises(ValueError, match="version"):
        Profile.load(path)
