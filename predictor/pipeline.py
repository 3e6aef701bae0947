"""Training and retraining end to end: buckets from the training lengths, tokenizer and model,
the training loop, calibration of the expectation on validation data, and a saved version."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from predictor import checkpoint as checkpoint_
from predictor import metadata, store
from predictor.buckets import Buckets, make_buckets
from predictor.evaluation import choose_point_estimate, estimates, point_figures
from predictor.inference import predict_proba
from predictor.labeled import LabeledSet
from predictor.model import ModelConfig, build_classifier, load_pretrained, pretrain_mlm, train_wordpiece
from predictor.training import TrainConfig, TrainResult, train

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Teacher:
    """What a student is distilled from: bucket probabilities (one model's, or the mean of an
    ensemble's) on each training prompt, and the bucket edges they refer to; optionally the vector
    each teacher's head read on each prompt (side by side for an ensemble), for ``--feature-weight``."""

    edges: list[float]
    probs: np.ndarray
    sources: list[str]  # model directories, for the record
    features: np.ndarray | None = None


def calibrate(buckets: Buckets, probs: np.ndarray, lengths: np.ndarray) -> Buckets:
    """Scale the expectation so that its sum over the validation set equals the true sum."""
    raw = buckets.expected(probs, calibrated=False).sum()
    true = float(np.asarray(lengths, dtype=np.float64).sum())
    if raw <= 0 or true <= 0:
        return buckets
    return buckets.with_calibration(true / raw)


def _val_figures(buckets: Buckets, lengths: np.ndarray):
    """History hook: Kendall tau and MAE of the median and expectation on the validation split."""

    def evaluate(probs: np.ndarray) -> dict:
        out = {}
        for name, est in estimates(buckets, probs).items():
            if name != "midpoint":
                f = point_figures(est, lengths)
                out[f"val_{name}_tau"], out[f"val_{name}_mae"] = f["kendall_tau"], f["mae_tokens"]
        return out

    return evaluate


def choose_estimate(buckets: Buckets, probs: np.ndarray, lengths: np.ndarray, result: TrainResult) -> None:
    """Score every point estimate on the validation split and record the declared one in ``result``."""
    figs = {
        name: {k: v for k, v in point_figures(est, lengths).items() if k in ("kendall_tau", "mae_tokens")}
        for name, est in estimates(buckets, probs).items()
    }
    result.val_estimates = figs
    result.point_estimate = choose_point_estimate(figs)
    log.info(
        "point estimate %s (validation: %s)",
        result.point_estimate,
        ", ".join(f"{n} tau {f['kendall_tau']:.3f} MAE {f['mae_tokens']:.1f}" for n, f in figs.items()),
    )


def fit(
    train_set: LabeledSet,
    val_set: LabeledSet,
    scheme: str = "quantile",
    n_buckets: int = 10,
    model_cfg: ModelConfig | None = None,
    train_cfg: TrainConfig | None = None,
    pretrained: str | os.PathLike | None = None,
    device: str = "cpu",
    progress: bool = True,
    l_max: float | None = None,
    mlm_epochs: float = 0.0,
    max_ratio: float | None = None,
    mlm_extra: list[str] | None = None,
    teacher: Teacher | None = None,
    checkpoint: str | os.PathLike | None = None,
    augmented: LabeledSet | None = None,
):
    """Build buckets, tokenizer and model from ``train_set`` and train; returns ``(model, tokenizer, buckets, result)``.

    ``mlm_epochs > 0`` first pre-trains a from-scratch encoder as a masked language model on the
    training prompts (:func:`predictor.model.pretrain_mlm`), plus ``mlm_extra`` texts when given
    (e.g. the training split's responses; never validation or test text). A ``teacher`` (same
    bucket edges) is distilled into the new model alongside the labels. ``checkpoint``: a file for
    the training state, resumed from when it exists (then MLM pre-training is skipped: the saved
    state holds the weights), see :func:`predictor.training.train`. ``augmented`` (noisy copies of
    training prompts, :mod:`predictor.augment`) joins the training examples after the bucket
    edges, the tokenizer and MLM pre-training have been made from the real prompts; a teacher's
    probabilities then cover ``train_set`` followed by ``augmented``.
    """
    model_cfg = model_cfg or ModelConfig()
    train_cfg = train_cfg or TrainConfig(max_len=model_cfg.max_len)
    buckets = make_buckets(train_set.lengths, scheme, n_buckets, l_max, max_ratio)
    log.info("%s buckets (%d): edges %s", buckets.scheme, buckets.n, [round(e, 1) for e in buckets.edges])
    if teacher is not None and list(teacher.edges) != list(buckets.edges):
        raise ValueError(
            f"the teacher's bucket edges ({', '.join(teacher.sources)}) differ from the new model's; "
            "train the student on the same data with the same --scheme, --buckets and --max-ratio"
        )
    if pretrained:
        torch.manual_seed(train_cfg.seed)  # the new bucket head's initial weights
        model, tok = load_pretrained(pretrained, buckets.n)
    else:
        tok = checkpoint_.saved_tokenizer(checkpoint)  # resuming: the run's own tokenizer
        if tok is None:
            t0 = time.monotonic()
            tok = train_wordpiece(train_set.prompts, model_cfg.vocab_size)
            log.info("trained a %d-token WordPiece tokenizer in %.1fs", len(tok), time.monotonic() - t0)
            checkpoint_.keep_tokenizer(checkpoint, tok)
        model = build_classifier(model_cfg, tok, buckets.n, seed=train_cfg.seed)
        if mlm_epochs > 0 and not (checkpoint and Path(checkpoint).is_file()):
            t0 = time.monotonic()
            enc = pretrain_mlm(
                model_cfg,
                tok,
                train_set.prompts + list(mlm_extra or []),
                mlm_epochs,
                truncation=train_cfg.truncation,
                seed=train_cfg.seed,
                device=device,
            )
            missing = model.load_state_dict(enc, strict=False)
            if any(k.startswith("distilbert.") for k in missing.missing_keys):
                raise RuntimeError(f"MLM encoder weights do not fit the classifier: {missing.missing_keys}")
            log.info("MLM pre-training: %.1f epochs in %.1fs", mlm_epochs, time.monotonic() - t0)
    model.to(device)
    log.info("model: %.2fM parameters", sum(p.numel() for p in model.parameters()) / 1e6)
    buckets, result = _train_and_calibrate(
        model,
        tok,
        buckets,
        train_set if augmented is None else train_set.concat(augmented),
        val_set,
        train_cfg,
        progress,
        _val_figures(buckets, val_set.lengths),
        None if teacher is None else teacher.probs,
        checkpoint,
        None if teacher is None else teacher.features,
    )
    return model, tok, buckets, result


def _train_and_calibrate(
    model,
    tokenizer,
    buckets: Buckets,
    train_set: LabeledSet,
    val_set: LabeledSet,
    train_cfg: TrainConfig,
    progress: bool,
    evaluate=None,
    teacher_probs: np.ndarray | None = None,
    checkpoint: str | os.PathLike | None = None,
    teacher_features: np.ndarray | None = None,
) -> tuple[Buckets, TrainResult]:
    """Train on ``buckets``' labels, then fit the calibration and declare the point estimate on validation."""
    result = train(
        model,
        tokenizer,
        train_set.prompts,
        buckets.label(train_set.lengths),
        val_set.prompts,
        buckets.label(val_set.lengths),
        train_cfg,
        progress,
        train_lengths=train_set.lengths,
        values=np.asarray(buckets.values),
        evaluate=evaluate,
        teacher_probs=teacher_probs,
        checkpoint_path=checkpoint,
        teacher_features=teacher_features,
    )
    probs = predict_proba(
        model, tokenizer, val_set.prompts, train_cfg.max_len, truncation=train_cfg.truncation
    )
    buckets = calibrate(buckets, probs, val_set.lengths)
    log.info("calibration factor %.3f", buckets.calibration)
    choose_estimate(buckets, probs, val_set.lengths, result)
    return buckets, result


def combine(
    members: list[store.LoadedModel],
    val_set: LabeledSet,
    progress: bool = False,
    probs: np.ndarray | None = None,
) -> tuple[Buckets, TrainResult]:
    """The bucket table (the first member's, calibration fit anew) and declared point estimate of the
    mean of ``members``' probabilities (``probs`` on ``val_set`` if already computed), both chosen on
    ``val_set`` as for any trained model."""
    members = [part for m in members for part in m.parts]
    store.check_same_edges(members, "ensemble")
    if probs is None:
        probs = np.mean([m.predict_proba(val_set.prompts, 128, progress) for m in members], axis=0)
    buckets = calibrate(members[0].buckets.with_calibration(1.0), probs, val_set.lengths)
    log.info("ensemble of %d: calibration factor %.3f", len(members), buckets.calibration)
    result = TrainResult()
    choose_estimate(buckets, probs, val_set.lengths, result)
    return buckets, result


def model_config(model: store.LoadedModel, train_cfg: TrainConfig) -> TrainConfig:
    """``train_cfg`` with what fine-tuning must keep from how a single ``model`` was trained: its
    prompt length and truncation, and its loss terms."""
    base = model.meta.get("train_config", {})
    return replace(
        train_cfg,
        max_len=model.max_len,
        truncation=model.truncation,
        log_weight=float(base.get("log_weight", 1.0)),
        ordinal_sigma=float(base.get("ordinal_sigma", 0.0)),
    )


@dataclass
class Retrained:
    """A retrained model: its bucket table and result and, for an ensemble, each member's
    (bucket table, result, training config)."""

    buckets: Buckets
    result: TrainResult
    config: TrainConfig
    members: list[tuple[Buckets, TrainResult, TrainConfig]]


def retrain(
    loaded: store.LoadedModel,
    train_set: LabeledSet,
    val_set: LabeledSet,
    train_cfg: TrainConfig,
    progress: bool = True,
) -> Retrained:
    """Fine-tune a loaded model in place on new data, keeping its tokenizer, bucket edges, prompt
    length and loss terms (:func:`model_config`); an ensemble: each member on the same data, then the
    mean's calibration and point estimate anew."""
    done = []
    for m in loaded.parts:
        cfg = model_config(m, train_cfg)
        buckets, result = _train_and_calibrate(
            m.model,
            m.tokenizer,
            m.buckets.with_calibration(1.0),  # re-fit from scratch on the new validation data
            train_set,
            val_set,
            cfg,
            progress,
        )
        done.append((buckets, result, cfg))
    if not loaded.members:
        return Retrained(*done[0], [])
    buckets, result = combine(list(loaded.members), val_set)
    return Retrained(buckets, result, train_cfg, done)


def save_retrained(
    out: str | os.PathLike, loaded: store.LoadedModel, retrained: Retrained, observed: int, original: int
) -> Path:
    """Save what :func:`retrain` made of ``loaded`` (from ``observed`` + ``original`` examples) as the
    next version under ``out``."""
    extra = metadata.retrain_extra(loaded, observed, original)
    if not loaded.members:
        return save_version(
            out,
            loaded.model,
            loaded.tokenizer,
            retrained.buckets,
            retrained.result,
            retrained.config,
            extra,
        )
    members = [
        replace(
            m,
            model=m.model.cpu(),
            buckets=b,
            meta=metadata.version_meta(cfg, r, metadata.retrain_extra(m, observed, original)),
        )
        for m, (b, r, cfg) in zip(loaded.members, retrained.members, strict=True)
    ]
    meta = metadata.ensemble_meta(retrained.config, retrained.result, extra)
    return store.save_ensemble(
        out,
        members,
        retrained.buckets,
        meta,
        metadata.ensemble_metrics(retrained.result, [r for _, r, _ in retrained.members]),
        [metadata.version_metrics(r) for _, r, _ in retrained.members],
    )


def save_version(
    out: str | os.PathLike,
    model,
    tokenizer,
    buckets: Buckets,
    result: TrainResult,
    train_cfg: TrainConfig,
    extra: dict | None = None,
) -> Path:
    """Save a trained model as the next version under ``out`` (see :mod:`predictor.metadata`)."""
    meta = metadata.version_meta(train_cfg, result, extra)
    return store.save(out, model.cpu(), tokenizer, buckets, meta, metadata.version_metrics(result))
