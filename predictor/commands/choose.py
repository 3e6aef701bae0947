"""``fleetbatch predictor choose``: (re)choose a saved model's declared point estimate on the validation split."""

from __future__ import annotations

import argparse

from predictor import metadata, store
from predictor.commands.common import model_arg, rounded, splits
from predictor.pipeline import choose_estimate
from predictor.training import TrainResult


def add_arguments(p: argparse.ArgumentParser) -> None:
    model_arg(p)


def run(args) -> dict:
    loaded = store.load(args.predictor, args.device)
    _, sp = splits(args)
    val = sp["val"]
    if not len(val):
        raise ValueError(f"the validation split of {args.dataset} is empty")
    probs = loaded.predict_proba(val.prompts, 128)
    result = TrainResult()
    choose_estimate(loaded.buckets, probs, val.lengths, result)
    metadata.record_point_estimate(loaded.path, result)
    return {
        "model": str(loaded.path),
        "previous": loaded.point_estimate,
        "point_estimate": result.point_estimate,
        "val_estimates": rounded(result.val_estimates),
    }
