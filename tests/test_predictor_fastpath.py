"""The predictor's fast serving path: ONNX Runtime members (predictor.fastpath), their export and the
validation rule that chose the recipe (predictor.fast_build), and ``predictor bench --compare``."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from predictor import fast_build, fastpath, onnx_export, shipped, store
from predictor.cli import main as predictor_main
from predictor.labeled import split
from predictor.pipeline import fit
from predictor.serving import LengthPredictor, load_shipped
from predictor.training import TrainConfig
from tests.predictor_fixtures import TINY, synthetic, write_jsonl

torch.set_num_threads(1)

# measured on the 2,089 validation and 2,149 test prompts (2026-11-28): the int8 members' bucket
# probabilities differ from the torch members' by at most 0.0094 (a member) and 0.0051 (their mean)
MEMBER_TOL = 0.02
MEAN_TOL = 0.01


def test_the_shipped_fast_members_match_the_torch_members():
    loaded = store.load(shipped.SHIPPED_DIR)
    fast = fastpath.load(loaded)
    assert fast is not None and fast.name == "ort-int8" and len(fast.members) == len(loaded.parts) == 2
    ref = json.loads((shipped.SHIPPED_DIR / shipped.REFERENCE_FILE).read_text())
    prompts = ref["prompts"] + synthetic(48, seed=2).prompts + ["x " * 300]  # one cut to max_len
    with torch.inference_mode():
        torch_probs = [m.predict_proba(prompts) for m in loaded.parts]
    fast_probs = [m.predict_proba(prompts) for m in fast.members]
    for t, f in zip(torch_probs, fast_probs, strict=True):
        assert np.abs(t - f).max() < MEMBER_TOL
    mean = fast.predict_proba(prompts)
    assert np.abs(mean - np.mean(torch_probs, axis=0)).max() < MEAN_TOL
    np.testing.assert_allclose(mean.sum(1), 1.0, atol=1e-9)
    assert mean[: len(ref["prompts"])].argmax(1).tolist() == ref["bucket"]  # measured: all 16 agree
    assert fast.predict_proba([]).shape == (0, loaded.buckets.n)


def test_the_shipped_predictor_serves_through_the_fast_path(caplog):
    with caplog.at_level(logging.INFO, logger="predictor.serving"):
        pred = load_shipped()
    assert pred.backend == "onnxruntime:ort-int8" and pred.fast_model is not None
    assert any("served by onnxruntime:ort-int8" in r.getMessage() for r in caplog.records)
    recipe = fastpath.read_recipe(shipped.SHIPPED_DIR)
    assert recipe["recipe"] == fast_build.choose(recipe["val_tau_torch"], recipe["candidates"])
    for name in store.member_names(shipped.SHIPPED_DIR):
        assert (shipped.SHIPPED_DIR / name / recipe["file"]).is_file()
    slow = LengthPredictor(store.load(shipped.SHIPPED_DIR), shipped.SHIPPED_DIR, fast=False)
    assert slow.backend == "torch" and slow.fast_model is None
    ref = json.loads((shipped.SHIPPED_DIR / shipped.REFERENCE_FILE).read_text())
    a, b = pred.predict(ref["prompts"]), slow.predict(ref["prompts"])
    assert [p.bucket for p in a] == [p.bucket for p in b] == ref["bucket"]
    np.testing.assert_allclose([p.expected_tokens for p in a], [p.expected_tokens for p in b], rtol=0.05)
    assert pred.reload() == pred.version and pred.backend.startswith("onnxruntime")
    # read for the fast path alone (no torch weights): the same predictions as the fast path of the
    # torch-loaded version, to the last bit
    assert all(p.model is None for p in pred._loaded.parts)
    prompts = ref["prompts"] + synthetic(48, seed=3).prompts + ["x " * 300]
    assert pred.predict(prompts) == LengthPredictor(store.load(shipped.SHIPPED_DIR), None).predict(prompts)


def test_a_gateway_serving_the_shipped_model_imports_neither_torch_nor_model_code():
    code = (
        "import sys; from predictor.serving import LengthPredictor;"
        "p = LengthPredictor.from_dir('shipped', threads=1); p.predict(['What is 7 times 8?']);"
        "print(p.backend, sorted(m for m in ('torch', 'transformers.models.distilbert') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["onnxruntime:ort-int8", "[]"]


def test_torch_serves_without_onnxruntime_or_with_a_broken_file(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(fastpath, "runtime_available", lambda: False)
    assert load_shipped().backend == "torch"
    monkeypatch.undo()
    copy = tmp_path / "model"
    shutil.copytree(shipped.SHIPPED_DIR, copy)
    (copy / "m2" / "model.int8.onnx").write_bytes(b"not onnx")
    with caplog.at_level(logging.ERROR, logger="predictor.fastpath"):
        pred = LengthPredictor.from_dir(copy)
    assert pred.backend == "torch" and not pred.is_fallback
    assert any("failed to load" in r.getMessage() for r in caplog.records)
    assert len(pred.predict(["What is 7 times 8?"])) == 1


def test_the_rule_takes_the_fastest_candidate_within_the_tolerance():
    cands = {
        "slow": {"val_tau": 0.7200, "ms_per_query": 2.0},
        "fast": {"val_tau": 0.7191, "ms_per_query": 1.0},
        "fastest": {"val_tau": 0.7185, "ms_per_query": 0.5},  # 0.0015 below: out
    }
    assert fast_build.TOLERANCE == 0.001
    assert fast_build.choose(0.7200, cands) == "fast"
    assert fast_build.choose(0.7200, cands, tolerance=0.002) == "fastest"
    assert fast_build.choose(0.7300, cands) is None


@pytest.fixture(scope="module")
def tiny_ensemble(tmp_path_factory):
    """Two copies of a tiny one-layer model as an ensemble, with a JSONL workload."""
    data = synthetic(240)
    sp = split(data)
    cfg = TrainConfig(epochs=2, lr=1e-2, batch_size=32, max_len=TINY.max_len, patience=10)
    model, tok, buckets, _ = fit(sp["train"], sp["val"], "quantile", 5, TINY, cfg, progress=False)
    d = tmp_path_factory.mktemp("fast")
    one = store.save(d / "one", model, tok, buckets, {"max_len": TINY.max_len, "truncation": "head_tail"})
    member = store.load(one)
    vdir = store.save_ensemble(d / "ens", [member, member], buckets, {"point_estimate": "expected"})
    return vdir, write_jsonl(data, d / "w.jsonl")


def test_export_keeps_the_logits(tiny_ensemble, tmp_path):
    member = store.load(tiny_ensemble[0]).members[0]
    path = onnx_export.export(member.model, tmp_path / "m.onnx")
    assert not member.model.training  # the exporter restores the mode it found
    run = fastpath.session(path, 1)
    for batch, width in ((1, 5), (3, 32)):
        ids = torch.randint(5, 300, (batch, width))
        mask = torch.ones_like(ids)
        mask[0, width // 2 + 1 :] = 0
        with torch.inference_mode():
            want = member.model(input_ids=ids, attention_mask=mask).logits.numpy()
        (got,) = run.run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})
        np.testing.assert_allclose(got, want, atol=1e-4)


def test_build_then_bench_compare_reports_ratio_and_taus(tiny_ensemble, capsys):
    vdir, jsonl = tiny_ensemble
    # a model trained for seconds predicts nearly alike: fp noise moves its tau by whole pairs, so any
    # candidate may miss the rule's 0.001; tolerance 1 keeps the fastest (the rule has its own test)
    record = fast_build.build(vdir, dataset=str(jsonl), n_time=32, batch_size=16, tolerance=1.0)
    assert record["recipe"] in fast_build.CANDIDATES and set(record["candidates"]) == set(
        fast_build.CANDIDATES
    )
    assert record["candidates"]["ort-fp32"]["max_abs_prob_diff"] < 1e-4
    assert sorted(p.name for p in vdir.glob("m*/*.onnx")) == [record["file"]] * 2
    assert (
        predictor_main(["bench", "--predictor", str(vdir), "--dataset", str(jsonl), "-n", "32", "--compare"])
        == 0
    )
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("ms_per_query_shipped", "ms_per_query_fast", "ms_ratio_to_shipped"):
        assert r[key] > 0, key
    for key in ("tau_shipped", "tau_fast", "val_tau_shipped", "val_tau_fast"):
        assert -1 <= r[key] <= 1, key  # a model trained for seconds: any tau
    assert {"val_tau_shipped", "val_tau_fast", "rule", "recipe"} <= set(r) and r["queries"] == 32
    assert r["backend_fast"] == f"onnxruntime:{record['recipe']}" and r["backend_shipped"] == "torch"
    assert record["recipe"] == fast_build.choose(record["val_tau_torch"], record["candidates"], 1.0)
    one = str(vdir.parent.parent / "one")
    assert predictor_main(["bench", "--predictor", one, "--dataset", str(jsonl), "-n", "8", "--compare"]) != 0
