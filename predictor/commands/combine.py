"""``fleetbatch predictor combine``: several trained models as one ensemble version (the mean of their bucket
probabilities), with its calibration and declared point estimate fit on the validation split."""

from __future__ import annotations

import argparse
import logging
import time

import numpy as np
import torch

from predictor import ensemble, metadata, store
from predictor.commands.common import comma_list, rounded, splits
from predictor.evaluation import estimates, point_figures
from predictor.pipeline import combine

log = logging.getLogger("predictor")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--members",
        required=True,
        metavar="DIRS",
        help="comma-separated model directories (versions or parents; 'shipped'; an ensemble counts as its "
        "members) trained on the same data and bucketing, so that they share bucket edges",
    )
    p.add_argument("--out", required=True, help="parent directory to write the ensemble version into")


def _val_figures(model: store.LoadedModel, probs: np.ndarray, lengths: np.ndarray) -> dict:
    """Kendall tau and MAE of ``model``'s declared estimate on validation probabilities."""
    f = point_figures(estimates(model.buckets, probs)[model.point_estimate], lengths)
    return {
        "point_estimate": model.point_estimate,
        "kendall_tau": f["kendall_tau"],
        "mae_tokens": f["mae_tokens"],
    }


def run(args: argparse.Namespace) -> dict:
    dirs = comma_list(args.members)
    members = ensemble.single_models([store.load(d, args.device) for d in dirs])
    if len(members) < 2:
        raise ValueError(f"--members names {len(members)} model; an ensemble needs at least two")
    paths = [m.path.resolve() for m in members]
    if len(set(paths)) != len(paths):
        raise ValueError("--members names one model more than once")
    store.check_same_edges(members, "--members")
    _, sp = splits(args)
    val = sp["val"]
    if not len(val):
        raise ValueError(f"the validation split of {args.dataset} is empty")
    probs = [m.predict_proba(val.prompts, 128) for m in members]
    alone = [_val_figures(m, p, val.lengths) for m, p in zip(members, probs, strict=True)]
    buckets, result = combine(members, val, probs=np.mean(probs, axis=0))
    meta = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "data": args.dataset,
        "combined_from": [{"path": str(m.path), "version": m.version} for m in members],
        "torch": torch.__version__,
        "point_estimate": result.point_estimate,
    }
    metrics = metadata.ensemble_metrics(result) | {"members_val": alone}
    vdir = store.save_ensemble(args.out, members, buckets, meta, metrics)
    declared = result.val_estimates[result.point_estimate]
    return {
        "model_dir": str(vdir),
        "version": vdir.name,
        "members": [str(m.path) for m in members],
        "calibration": round(buckets.calibration, 4),
        "point_estimate": result.point_estimate,
        "val_kendall_tau": round(declared["kendall_tau"], 4),
        "val_mae_tokens": round(declared["mae_tokens"], 4),
        "val_estimates": rounded(result.val_estimates),
        "members_val": rounded({str(m.path): a for m, a in zip(members, alone, strict=True)}),
    }
