"""Training, saving/loading versions, and the serving predictor (concurrency, reload, fallback)."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np
import pytest
import torch
from transformers import DistilBertForMaskedLM

from predictor import store
from predictor.buckets import make_buckets
from predictor.evaluation import choose_point_estimate
from predictor.inference import encode, predict_proba
from predictor.labeled import LabeledSet, split
from predictor.model import (
    build_classifier,
    distilbert_config,
    load_pretrained,
    pretrain_mlm,
    train_wordpiece,
)
from predictor.pipeline import Teacher, fit, save_version
from predictor.serving import LengthPrediction, LengthPredictor
from predictor.training import TrainConfig, rank_loss, soft_targets
from tests.predictor_fixtures import TINY, synthetic

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def data():
    return split(synthetic(600))


@pytest.fixture(scope="module")
def trained(data):
    cfg = TrainConfig(epochs=6, lr=1e-2, batch_size=32, max_len=TINY.max_len, patience=10)
    return fit(data["train"], data["val"], "quantile", 6, TINY, cfg, progress=False)


@pytest.fixture(scope="module")
def saved(trained, tmp_path_factory):
    model, tok, buckets, result = trained
    parent = tmp_path_factory.mktemp("models")
    save_version(parent, model, tok, buckets, result, TrainConfig(max_len=TINY.max_len))
    return parent


def test_training_lowers_validation_loss_and_learns(trained, data):
    model, tok, buckets, result = trained
    assert result.best_val_loss < result.initial_val_loss - 0.3
    assert result.history and result.steps > 0
    assert {"val_median_tau", "val_median_mae", "val_expected_tau"} <= set(result.history[-1])
    probs = predict_proba(model, tok, data["test"].prompts, TINY.max_len)
    exp = buckets.expected(probs)
    kinds = np.array(data["test"].sources)
    # the model has learnt that stories are long and brief answers short
    assert exp[kinds == "story"].mean() > 3 * exp[kinds == "brief"].mean()
    # calibration makes the validation sum match
    assert 0.5 < buckets.calibration < 2.0


def test_save_load_round_trip_gives_identical_predictions(trained, saved, data):
    model, tok, buckets, _ = trained
    pred = LengthPredictor.from_dir(saved)  # the parent: resolves to latest
    assert pred.version == "v1" and not pred.is_fallback
    prompts = data["test"].prompts[:50]
    got = pred.predict(prompts)
    probs = predict_proba(model, tok, prompts, TINY.max_len)
    assert [p.bucket for p in got] == probs.argmax(1).tolist()
    assert np.allclose([p.expected_tokens for p in got], buckets.expected(probs), rtol=1e-5)
    assert np.allclose([p.midpoint_tokens for p in got], buckets.midpoint(probs.argmax(1)))
    assert np.allclose([p.median_tokens for p in got], buckets.median(probs))
    assert pred.point_estimate in ("expected", "median", "midpoint")
    assert pred.point_estimate == store.load(saved).point_estimate
    assert got[0].estimate(pred.point_estimate) == getattr(got[0], f"{pred.point_estimate}_tokens")
    again = LengthPredictor.from_dir(saved / "v1").predict(prompts)  # the version dir itself
    assert again == got


def test_batching_does_not_change_answers(saved, data):
    pred = LengthPredictor.from_dir(saved)
    prompts = data["test"].prompts[:40]
    whole = pred.predict(prompts)
    single = [pred.predict([p])[0] for p in prompts]
    assert [p.bucket for p in whole] == [p.bucket for p in single]
    assert np.allclose([p.expected_tokens for p in whole], [p.expected_tokens for p in single], rtol=1e-4)


def test_concurrent_inference_matches_serial(saved, data):
    pred = LengthPredictor.from_dir(saved)
    prompts = data["test"].prompts
    chunks = [prompts[i : i + 7] for i in range(0, len(prompts), 7)]
    serial = [pred.predict(c) for c in chunks]
    with ThreadPoolExecutor(max_workers=8) as ex:
        parallel = list(ex.map(pred.predict, chunks))
    assert parallel == serial

    async def gateway_like():
        return await asyncio.gather(*(asyncio.to_thread(pred.predict, c) for c in chunks))

    assert asyncio.run(gateway_like()) == serial


def test_point_estimate_is_chosen_on_validation_and_saved(trained, saved):
    result = trained[3]
    assert set(result.val_estimates) == {"expected", "median", "midpoint"}
    assert result.point_estimate == choose_point_estimate(result.val_estimates)
    assert store.load(saved).meta["point_estimate"] == result.point_estimate
    # the rule: the lowest validation MAE, whatever the (tie-inflated) tau of the midpoint
    figs = {
        "expected": {"kendall_tau": 0.66, "mae_tokens": 30.0},
        "median": {"kendall_tau": 0.68, "mae_tokens": 28.0},
        "midpoint": {"kendall_tau": 0.70, "mae_tokens": 29.0},
    }
    assert choose_point_estimate(figs) == "median"
    figs["expected"]["mae_tokens"] = 28.0
    assert choose_point_estimate(figs) == "expected"


def test_hot_reload_picks_up_new_version(trained, saved, data, tmp_path):
    model, tok, buckets, result = trained
    parent = tmp_path / "runs"
    save_version(parent, model, tok, buckets, result, TrainConfig(max_len=TINY.max_len))
    pred = LengthPredictor.from_dir(parent)
    before = pred.predict(data["test"].prompts[:5])
    assert pred.version == "v1"
    # a new version with a different calibration: reload() on the parent swaps it in
    save_version(
        parent,
        model,
        tok,
        buckets.with_calibration(2 * buckets.calibration),
        result,
        TrainConfig(max_len=TINY.max_len),
    )
    assert (parent / "latest").read_text().strip() == "v2"
    assert pred.reload() == "v2" and pred.version == "v2"
    after = pred.predict(data["test"].prompts[:5])
    assert np.allclose([a.expected_tokens for a in after], [2 * b.expected_tokens for b in before], rtol=1e-5)
    # a broken directory leaves the running model in place
    with pytest.raises(FileNotFoundError):
        pred.reload(tmp_path / "nowhere")
    assert pred.version == "v2"


def test_incomplete_version_is_ignored(saved, tmp_path):
    parent = tmp_path / "p"
    parent.mkdir()
    (parent / "v1").symlink_to(saved / "v1", target_is_directory=True)
    (parent / "v2").mkdir()  # half-written: no buckets.json
    assert store.resolve(parent).name == "v1"
    assert store.next_version_dir(parent).name == "v3"
    with pytest.raises(FileNotFoundError):
        store.resolve(tmp_path / "empty")


def test_fallback_without_model_warns_once(caplog):
    with caplog.at_level(logging.WARNING, logger="predictor.serving"):
        pred = LengthPredictor.from_dir(None)
        out = pred.predict(["one two three", "a " * 1000])
        pred.predict(["more"])
    assert pred.is_fallback and pred.version == "fallback"
    assert all(isinstance(p, LengthPrediction) and p.bucket == -1 for p in out)
    assert all(p.median_tokens == p.expected_tokens == p.midpoint_tokens for p in out)
    assert pred.point_estimate == "expected"
    assert out[0].expected_tokens < out[1].expected_tokens <= 512
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "heuristic" in warnings[0].getMessage()
    assert pred.predict([]) == []
    with pytest.raises(TypeError):
        pred.predict("a single string")


def test_head_tail_truncation_keeps_both_ends(trained):
    tok = trained[1]
    prompt = "brief " + "city " * 50 + "story"
    both = encode(tok, [prompt], 8, "head_tail")[0]
    head = encode(tok, [prompt], 8, "head")[0]
    assert len(both) == len(head) == 8
    assert "brief" in tok.decode(both) and "story" in tok.decode(both)
    assert "story" not in tok.decode(head)
    assert encode(tok, ["brief city"], 8)[0] == encode(tok, ["brief city"], 8, "head")[0]
    with pytest.raises(ValueError):
        encode(tok, [prompt], 8, "middle")


def test_mlm_pretraining_gives_encoder_weights(data):
    tok = train_wordpiece(data["train"].prompts, TINY.vocab_size)
    enc = pretrain_mlm(TINY, tok, data["train"].prompts[:200], epochs=1, batch_size=50)
    model = build_classifier(TINY, tok, 4)
    before = model.distilbert.embeddings.word_embeddings.weight.detach().clone()
    missing = model.load_state_dict(enc, strict=False).missing_keys
    assert enc and all(k.startswith("distilbert.") for k in enc)
    assert not [k for k in missing if k.startswith("distilbert.")]
    assert not torch.equal(before, model.distilbert.embeddings.word_embeddings.weight)


def test_soft_ordinal_targets_and_ema():
    t = soft_targets(torch.tensor([0, 2]), 5, 1.0)
    assert torch.allclose(t.sum(1), torch.ones(2))
    assert t[1].argmax() == 2 and t[1, 1] == t[1, 3] and t[1, 0] < t[1, 1]
    with pytest.raises(ValueError):
        TrainConfig(ema=1.0)


def test_rank_loss_rewards_the_right_order():
    values = torch.tensor([10.0, 100.0, 1000.0])
    lengths = torch.tensor([8.0, 90.0, 1200.0])
    right = torch.tensor([[4.0, 0, 0], [0, 4.0, 0], [0, 0, 4.0]], requires_grad=True)
    wrong = right.detach().flip(0)
    assert rank_loss(right, lengths, values) < rank_loss(wrong, lengths, values)
    rank_loss(right, lengths, values).backward()
    assert right.grad is not None and right.grad.abs().sum() > 0
    # equal lengths form no pair: no loss
    flat = rank_loss(right.detach(), torch.tensor([5.0, 5.0, 5.0]), values)
    assert float(flat) == 0.0
    with pytest.raises(ValueError):
        TrainConfig(rank_weight=-1.0)


def test_pretrained_checkpoint_path(data, tmp_path):
    """The production path: a local DistilBERT checkpoint (MLM weights + tokenizer) gets a bucket head."""
    tok = train_wordpiece(data["train"].prompts, TINY.vocab_size)
    torch.manual_seed(0)  # fit seeds the new head; the stand-in checkpoint must not depend on earlier tests
    checkpoint = DistilBertForMaskedLM(distilbert_config(TINY, tok))
    checkpoint.save_pretrained(tmp_path / "ckpt")
    tok.save_pretrained(tmp_path / "ckpt")
    model, tok2 = load_pretrained(tmp_path / "ckpt", 5)
    assert model.config.num_labels == 5 and tok2.get_vocab() == tok.get_vocab()
    assert torch.equal(
        model.distilbert.embeddings.word_embeddings.weight,
        checkpoint.distilbert.embeddings.word_embeddings.weight,
    )
    cfg = TrainConfig(epochs=6, lr=1e-2, max_len=TINY.max_len, patience=10)
    model, tok3, buckets, result = fit(
        data["train"], data["val"], "quantile", 5, TINY, cfg, pretrained=tmp_path / "ckpt", progress=False
    )
    assert buckets.n == 5 and result.best_val_loss < result.initial_val_loss
    with pytest.raises(FileNotFoundError):
        load_pretrained(tmp_path, 5)


def test_distilling_a_teacher_pulls_the_student_towards_it(data):
    """With the teacher's rows in the target, the student follows a teacher that disagrees with the labels."""
    train = data["train"].sample(200, 0)
    # validation answers are all short too, so early stopping keeps what the teacher taught
    val = LabeledSet(data["val"].prompts, [1] * len(data["val"]), data["val"].sources)
    edges = make_buckets(train.lengths, "quantile", 4).edges
    teacher = np.zeros((len(train), len(edges) - 1), dtype=np.float32)
    teacher[:, 0] = 1.0  # "every answer is in the shortest bucket"
    cfg = TrainConfig(epochs=2, lr=1e-2, max_len=TINY.max_len, patience=10, teacher_weight=1.0)
    shares = []
    for t in (None, Teacher(list(edges), teacher, ["t"])):
        model, tok, _, _ = fit(train, val, "quantile", 4, TINY, cfg, progress=False, teacher=t)
        shares.append(predict_proba(model, tok, val.prompts, TINY.max_len)[:, 0].mean())
    assert shares[1] > shares[0] + 0.2 and shares[1] > 0.6
    wrong_edges = Teacher([e + 1 for e in edges], teacher, ["t"])
    with pytest.raises(ValueError, match="bucket edges"):
        fit(train, val, "quantile", 4, TINY, cfg, progress=False, teacher=wrong_edges)
    with pytest.raises(ValueError, match="one row"):
        fit(
            train,
            val,
            "quantile",
            4,
            TINY,
            cfg,
            progress=False,
            teacher=Teacher(list(edges), teacher[:5], ["t"]),
        )
    with pytest.raises(ValueError):
        TrainConfig(teacher_weight=1.5)


def test_training_resumes_from_its_checkpoint(data, tmp_path):
    """A run stopped by the time cap keeps its checkpoint; the same run again goes on from there and
    ends where an uninterrupted run ends (same weights), then removes the checkpoint."""
    train = data["train"].sample(160, 0)
    tok = train_wordpiece(train.prompts, TINY.vocab_size)
    torch.manual_seed(0)
    DistilBertForMaskedLM(distilbert_config(TINY, tok)).save_pretrained(tmp_path / "ckpt")
    tok.save_pretrained(tmp_path / "ckpt")  # a pretrained checkpoint: the same tokenizer every time
    cfg = TrainConfig(epochs=2, lr=1e-2, batch_size=32, max_len=TINY.max_len, patience=10, ema=0.9)
    args = (train, data["val"], "quantile", 4, TINY)
    full_model, _, _, full = fit(*args, cfg, pretrained=tmp_path / "ckpt", progress=False)
    state = tmp_path / "state.pt"
    capped = replace(cfg, max_minutes=1e-9)  # out of time after one step: stops at the first evaluation
    _, _, _, first = fit(*args, capped, pretrained=tmp_path / "ckpt", progress=False, checkpoint=state)
    assert first.steps == 2 == first.history[-1]["step"] and first.stopped_early and state.is_file()
    model, _, _, rest = fit(*args, cfg, pretrained=tmp_path / "ckpt", progress=False, checkpoint=state)
    assert not state.exists() and rest.steps == full.steps
    assert [h["step"] for h in rest.history] == [h["step"] for h in full.history]  # no evaluation of its own
    assert rest.initial_val_loss == full.initial_val_loss
    prompts = data["test"].prompts
    np.testing.assert_allclose(
        predict_proba(model, tok, prompts, TINY.max_len),
        predict_proba(full_model, tok, prompts, TINY.max_len),
        atol=1e-5,
    )
    # from scratch, the run's own WordPiece tokenizer is kept beside the checkpoint and reused
    _, tok1, _, _ = fit(*args, capped, progress=False, checkpoint=state)
    assert (tmp_path / "state.pt.tokenizer").is_dir()
    _, tok2, _, rest = fit(*args, cfg, progress=False, checkpoint=state)
    assert tok2.get_vocab() == tok1.get_vocab() and rest.steps == full.steps
    assert not state.exists() and not (tmp_path / "state.pt.tokenizer").exists()
    # a checkpoint of another run is refused
    torch.save({"fingerprint": "other", "step": 3}, state)
    with pytest.raises(ValueError, match="another run"):
        fit(*args, cfg, progress=False, checkpoint=state)
    # so is one of the same data with other settings (before: resumed, mixing two runs)
    state.unlink()
    fit(*args, replace(capped, lr=3e-3), pretrained=tmp_path / "ckpt", progress=False, checkpoint=state)
    with pytest.raises(ValueError, match="another run"):
        fit(*args, cfg, pretrained=tmp_path / "ckpt", progress=False, checkpoint=state)
