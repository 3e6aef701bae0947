"""The length predictor shipped with the project: package data, fp16 round trip, and its use by
``fleetbatch gateway up`` / ``fleetbatch loadgen demo``; ``fleetbatch predictor eval`` on any alpaca_eval answer file."""

from __future__ import annotations

import hashlib
import json
import logging
import subprocess
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from gateway.cli import build_parser as gateway_parser
from gateway.deploy.up import gateway_config
from predictor import choice, shipped, store
from predictor.cli import main as predictor_main
from predictor.labeled import split
from predictor.pipeline import fit, save_version
from predictor.serving import LengthPredictor, load_shipped
from predictor.training import TrainConfig
from tests.predictor_fixtures import TINY, save_small_tokenizer, synthetic

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny_source(tmp_path_factory) -> Path:
    """A tiny fp32 model trained for a few seconds, saved as a version directory."""
    data = split(synthetic(300))
    cfg = TrainConfig(epochs=3, lr=1e-2, batch_size=32, max_len=TINY.max_len, patience=10)
    model, tok, buckets, result = fit(data["train"], data["val"], "quantile", 5, TINY, cfg, progress=False)
    parent = tmp_path_factory.mktemp("src")
    return save_version(parent, model, tok, buckets, result, TrainConfig(max_len=TINY.max_len))


@pytest.fixture(scope="module")
def tiny_shipped(tiny_source, tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("pkg") / "shipped_model"
    info = {"name": "test-tokenizer", "vocab_size": 300, "vocab_sha1": "0" * 40}
    prompts = [p for p in synthetic(24, seed=5).prompts]
    return shipped.export(tiny_source, dest, serving_tokenizer=info, prompts=prompts)


def test_shipped_model_is_package_data_under_the_size_limit():
    d = shipped.SHIPPED_DIR
    assert (d / "buckets.json").is_file() and (d / "predictor.json").is_file()
    for part in store.member_names(d) or ["."]:  # one model, or each member of an ensemble
        for f in ("model.safetensors", "config.json", "tokenizer.json", "buckets.json", "predictor.json"):
            assert (d / part / f).is_file(), f"{part}/{f}"
        with safe_open(str(d / part / "model.safetensors"), framework="pt") as f:
            assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float16}
    assert shipped.REFERENCE_FILE in {p.name for p in d.iterdir()}
    assert sum(p.stat().st_size for p in d.rglob("*") if p.is_file()) <= shipped.MAX_BYTES
    meta = json.loads((d / "predictor.json").read_text())
    tok = meta["shipped"]["serving_tokenizer"]
    assert tok["name"] == shipped.DEFAULT_SERVING_TOKENIZER and tok["vocab_size"] > 0
    assert len(tok["vocab_sha1"]) == 40
    assert {"kendall_tau", "mae_tokens"} <= set(meta["shipped"]["test"])
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["predictor"]
    assert {"shipped_model/*", "shipped_model/*/*"} <= set(patterns)  # an ensemble's members too
    fast = json.loads((d / "fast.json").read_text())["file"]  # the fast path's ONNX members
    for part in store.member_names(d) or ["."]:
        for name in ("model.safetensors", fast):
            ignored = subprocess.run(["git", "check-ignore", "-q", str(d / part / name)], cwd=REPO)
            assert ignored.returncode == 1, "the shipped model must not be git-ignored"


def test_shipped_model_predicts_like_the_fp32_model_it_was_saved_from():
    ref = json.loads((shipped.SHIPPED_DIR / shipped.REFERENCE_FILE).read_text())
    pred = load_shipped()
    assert not pred.is_fallback and pred.version.startswith("shipped-")
    loaded = store.load(shipped.SHIPPED_DIR)
    assert all(next(m.model.parameters()).dtype == torch.float32 for m in loaded.parts)
    probs = loaded.predict_proba(ref["prompts"])
    assert np.abs(probs - np.asarray(ref["probs"])).max() < 1e-3  # fp16 weights: measured 4e-5
    torch_members = LengthPredictor(loaded, shipped.SHIPPED_DIR, fast=False)
    out = torch_members.predict(ref["prompts"])
    assert [p.bucket for p in out] == ref["bucket"]
    np.testing.assert_allclose([p.expected_tokens for p in out], ref["expected_tokens"], rtol=1e-3)
    out = pred.predict(ref["prompts"])  # the fast path (int8, tests/test_predictor_fastpath.py)
    assert [p.bucket for p in out] == ref["bucket"]
    np.testing.assert_allclose([p.expected_tokens for p in out], ref["expected_tokens"], rtol=0.02)  # 0.0062
    # the reference is not flat: the prompts get clearly different lengths
    assert max(ref["expected_tokens"]) > 3 * min(ref["expected_tokens"])


def test_export_round_trip_keeps_predictions(tiny_source, tiny_shipped):
    src = LengthPredictor.from_dir(tiny_source)
    fp16 = LengthPredictor.from_dir(tiny_shipped)
    prompts = synthetic(60, seed=9).prompts
    a, b = src.predict(prompts), fp16.predict(prompts)
    assert [p.bucket for p in a] == [p.bucket for p in b]
    np.testing.assert_allclose([p.expected_tokens for p in a], [p.expected_tokens for p in b], rtol=5e-3)
    np.testing.assert_allclose([p.median_tokens for p in a], [p.median_tokens for p in b], rtol=1e-2)
    meta = json.loads((tiny_shipped / "predictor.json").read_text())
    assert meta["shipped"]["serving_tokenizer"]["name"] == "test-tokenizer"
    weights = hashlib.sha1((tiny_shipped / "model.safetensors").read_bytes()).hexdigest()[:8]
    assert meta["shipped"]["from_version"] == "v1" and fp16.version == f"shipped-v1-{weights}"
    assert src.point_estimate == fp16.point_estimate
    # only the position embeddings that max_len reaches are shipped; the source keeps all of them
    config = json.loads((tiny_shipped / "config.json").read_text())
    assert (
        config["max_position_embeddings"]
        == TINY.max_len
        < store.load(tiny_source).model.config.max_position_embeddings
    )
    ref = json.loads((tiny_shipped / shipped.REFERENCE_FILE).read_text())
    assert ref["bucket"] == [p.bucket for p in src.predict(ref["prompts"])]
    with pytest.raises(ValueError, match="limit"):
        shipped.export(tiny_source, tiny_shipped.parent / "too_big", max_bytes=10_000)
    assert not (tiny_shipped.parent / "too_big").exists()


def test_record_eval_stores_the_test_figures(tiny_shipped):
    figures = shipped.record_eval({"kendall_tau": 0.5, "mae_tokens": 12.0, "other": 1}, tiny_shipped)
    assert figures == {"kendall_tau": 0.5, "mae_tokens": 12.0}
    loaded = store.load(tiny_shipped)
    assert "test tau 0.500, MAE 12.0 tokens" in shipped.describe(loaded)


def test_gateway_up_uses_the_shipped_predictor_by_default(caplog):
    args = gateway_parser().parse_args(["up"])
    config = gateway_config(args, "redis://127.0.0.1:1/0", "token", [])
    assert config.predictor_dir == "shipped"
    with caplog.at_level(logging.INFO, logger="predictor.serving"):
        pred = LengthPredictor.from_dir(config.predictor_dir)
    assert not pred.is_fallback and pred.version.startswith("shipped-")
    assert any("length predictor: learned (shipped-" in r.getMessage() for r in caplog.records)
    heuristic = gateway_config(gateway_parser().parse_args(["up", "--predictor", "heuristic"]), "r", "t", [])
    assert LengthPredictor.from_dir(heuristic.predictor_dir).is_fallback
    other = gateway_config(gateway_parser().parse_args(["up", "--predictor", "/models/p"]), "r", "t", [])
    assert other.predictor_dir == "/models/p"


def test_broken_shipped_model_falls_back_to_the_heuristic(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(choice, "SHIPPED_DIR", tmp_path)  # where the choice of a predictor reads it
    with caplog.at_level(logging.WARNING, logger="predictor.serving"):
        pred = LengthPredictor.from_dir("shipped")
    assert pred.is_fallback
    assert any(r.levelno == logging.ERROR and "failed to load" in r.getMessage() for r in caplog.records)
    with pytest.raises(FileNotFoundError):  # a directory the user names must load
        LengthPredictor.from_dir(tmp_path / "elsewhere")


def test_demo_starts_gateway_up_with_the_chosen_predictor(monkeypatch, tmp_path):
    import load.cli
    import load.deployment

    seen = []

    class Exited:
        pid = returncode = 1

        def __init__(self, cmd, **kwargs):
            seen.append(cmd)

        def poll(self):
            return 1

    monkeypatch.setattr(load.deployment.subprocess, "Popen", Exited)
    assert load.cli.main(["demo", "--run-dir", str(tmp_path)]) == 1
    assert load.cli.main(["demo", "--run-dir", str(tmp_path), "--predictor", "heuristic"]) == 1
    for cmd, want in zip(seen, ("shipped", "heuristic"), strict=True):
        assert cmd[cmd.index("--predictor") + 1] == want
        assert gateway_parser().parse_args(cmd[3:]).predictor == want


def test_eval_on_any_alpaca_eval_answer_file(tiny_shipped, tmp_path, capsys):
    data = synthetic(90, seed=3)
    (tmp_path / "alpaca_eval").mkdir()
    rows = [
        {"instruction": p, "output": " ".join(["word"] * int(n))}
        for p, n in zip(data.prompts, data.lengths, strict=True)
    ]
    (tmp_path / "alpaca_eval" / "brand-new-model.json").write_text(json.dumps(rows))
    tok = tmp_path / "tok"
    save_small_tokenizer(tok)
    common = ["--data-dir", str(tmp_path), "--served-model", str(tok), "--split", "all"]
    rc = predictor_main(
        ["eval", "--predictor", str(tiny_shipped), "--dataset", "alpaca_eval:brand-new-model", *common]
        + ["--no-baselines", "--plot", str(tmp_path / "cm.png")]
    )
    assert rc == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["n"] == 90 and r["kendall_tau"] > 0.3
    assert (
        predictor_main(["eval", "--predictor", str(tiny_shipped), "--dataset", "alpaca_eval:nobody", *common])
        != 0
    )
    assert "brand-new-model" in capsys.readouterr().err
