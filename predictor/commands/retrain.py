"""``fleetbatch predictor retrain``: MICO's continuous update, fine-tuning the latest version on the lengths
engines observed (Redis ``fb:observed``) plus a sample of the original training data."""

from __future__ import annotations

import argparse
import logging
from dataclasses import replace
from pathlib import Path

from predictor import store
from predictor.commands.common import DEFAULT_OUT, data_args, runtime_args, serving_tokenizer, splits
from predictor.labeled import label
from predictor.observed import read_observed
from predictor.pipeline import retrain, save_retrained
from predictor.training import TrainConfig, TrainResult

log = logging.getLogger("predictor")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--predictor", default=DEFAULT_OUT, help=f"parent directory of versions (default {DEFAULT_OUT})"
    )
    p.add_argument("--redis-url", required=True, metavar="URL", help="Redis URL holding fb:observed")
    p.add_argument("--observed-limit", type=int, default=None, help="use only the newest N observations")
    p.add_argument(
        "--original",
        type=int,
        default=4000,
        help="original training examples mixed in (default 4000; 0 for none)",
    )
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument(
        "--out", default=None, help="where to write the new version (default: the --predictor parent)"
    )
    p.add_argument("--seed", type=int, default=0)


def parser() -> argparse.ArgumentParser:
    """The options of ``fleetbatch predictor retrain`` alone (the same declarations as the CLI's subcommand)."""
    p = argparse.ArgumentParser(prog="fleetbatch predictor retrain")
    data_args(p)
    runtime_args(p)
    add_arguments(p)
    return p


def _losses(r: TrainResult) -> dict:
    return {
        "initial_val_loss": round(r.initial_val_loss, 4),
        "best_val_loss": round(r.best_val_loss, 4),
        "steps": r.steps,
    }


def run(args) -> dict:
    loaded = store.load(args.predictor, args.device)
    observed = read_observed(args.redis_url, args.observed_limit)
    if not observed:
        raise ValueError(f"no observed lengths in Redis at {args.redis_url}; nothing to retrain on")
    obs = label(observed, serving_tokenizer(args.served_model))
    _, sp = splits(args)
    original = sp["train"].sample(args.original, args.seed) if args.original else None
    train_set = obs if original is None else original.concat(obs)
    # prompt length, truncation and loss terms come from each model (pipeline.model_config)
    tc = replace(
        TrainConfig(), epochs=args.epochs, lr=args.lr, batch_size=args.batch_size, seed=args.seed, warmup=0.0
    )
    log.info(
        "retraining %s on %d observed + %d original examples",
        loaded.path,
        len(obs),
        len(train_set) - len(obs),
    )
    retrained = retrain(loaded, train_set, sp["val"], tc)
    result = retrained.result
    out = (
        Path(args.out)
        if args.out
        else (Path(args.predictor).parent if store.is_version_dir(args.predictor) else Path(args.predictor))
    )
    vdir = save_retrained(out, loaded, retrained, len(obs), len(train_set) - len(obs))
    return {
        "model_dir": str(vdir),
        "version": vdir.name,
        "retrained_from": loaded.version,
        "observed_examples": len(obs),
        "original_examples": len(train_set) - len(obs),
        # an ensemble's members each train (and early-stop) on their own
        **(
            _losses(result)
            if not retrained.members
            else {"members": [_losses(r) for _, r, _ in retrained.members]}
        ),
        "point_estimate": result.point_estimate,
    }
