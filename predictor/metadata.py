"""What a model version records about itself: ``predictor.json`` (how it was trained, its declared
point estimate) and ``metrics.json`` (validation history), written by ``train``, ``retrain`` and
``choose``. :mod:`predictor.store` writes and reads the files; this module decides their content."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from pathlib import Path

import torch

from predictor import store
from predictor.training import TrainConfig, TrainResult


def version_meta(train_cfg: TrainConfig, result: TrainResult, extra: dict | None = None) -> dict:
    """``predictor.json`` of a newly trained version: prompt handling, training config, ``extra``."""
    return {
        "max_len": train_cfg.max_len,
        "truncation": train_cfg.truncation,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "train_config": asdict(train_cfg),
        "torch": torch.__version__,
        **(extra or {}),
        "point_estimate": result.point_estimate,
    }


def version_metrics(result: TrainResult) -> dict:
    """``metrics.json`` of a newly trained version."""
    return {
        "initial_val_loss": result.initial_val_loss,
        "best_val_loss": result.best_val_loss,
        "best_step": result.best_step,
        "steps": result.steps,
        "stopped_early": result.stopped_early,
        "point_estimate": result.point_estimate,
        "val_estimates": result.val_estimates,
        "history": result.history,
    }


def ensemble_meta(train_cfg: TrainConfig, result: TrainResult, extra: dict | None = None) -> dict:
    """``predictor.json`` of a retrained ensemble: as :func:`version_meta`, less what only a member
    has (its prompt length and truncation; each member records its own)."""
    meta = version_meta(train_cfg, result, extra)
    for key in ("max_len", "truncation"):
        meta.pop(key)
    for key in ("max_len", "truncation", "log_weight", "ordinal_sigma"):
        meta["train_config"].pop(key)
    return meta


def ensemble_metrics(result: TrainResult, member_results: list[TrainResult] | None = None) -> dict:
    """``metrics.json`` of an ensemble version: the mean's validation figures and, when retrained,
    each member's training (each member's own ``metrics.json`` has it too)."""
    out = {"point_estimate": result.point_estimate, "val_estimates": result.val_estimates}
    if member_results:
        out["members"] = [version_metrics(r) for r in member_results]
    return out


def train_extra(
    args,
    model_config: dict,
    mlm_epochs: float,
    teacher_sources: list[str] | None,
    max_ratio: float | None,
    train_examples: int,
) -> dict:
    """What ``fleetbatch predictor train`` adds to ``predictor.json``: data, pre-training, teacher, model config."""
    return {
        "data": args.dataset,
        "mlm_epochs": mlm_epochs,
        "mlm_responses": bool(args.mlm_responses and not args.pretrained),
        "extra_train": args.extra_train,
        "teacher": teacher_sources,
        "augment": args.augment,  # noisy copies per training prompt (predictor.augment)
        "augment_seed": args.augment_seed,
        "max_ratio": max_ratio,
        "model_config": model_config,
        "train_examples": train_examples,
    }


def retrain_extra(loaded: store.LoadedModel, observed: int, original: int) -> dict:
    """``predictor.json`` additions of a retrained version: the base version's record and the data."""
    return {
        **{
            k: v for k, v in loaded.meta.items() if k not in ("version", "created", "train_config", "members")
        },
        "retrained_from": str(loaded.path),
        "observed_examples": observed,
        "original_examples": original,
    }


def record_point_estimate(vdir: Path, result: TrainResult) -> None:
    """Rewrite a saved version's declared point estimate (``predictor.json``, atomically) and its
    validation figures (``metrics.json``)."""
    meta_path = vdir / store.META_FILE
    meta = json.loads(meta_path.read_text(encoding="utf-8")) if meta_path.is_file() else {}
    meta["point_estimate"] = result.point_estimate
    tmp = meta_path.with_name(meta_path.name + ".tmp")
    tmp.write_text(json.dumps(meta, indent=2), encoding="utf-8")
    os.replace(tmp, meta_path)
    metrics = store.read_metrics(vdir)
    metrics.update({"point_estimate": result.point_estimate, "val_estimates": result.val_estimates})
    store.write_metrics(vdir, metrics)
