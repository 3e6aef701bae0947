"""What the subcommands share: the data and runtime options, the serving tokenizer, the splits."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from transformers import AutoTokenizer

from localmodels import default_tokenizer
from predictor.labeled import LabeledSet, load_labeled, split

log = logging.getLogger("predictor")

DEFAULT_OUT = "runs/predictor"


def data_args(p: argparse.ArgumentParser, lengths: bool = True) -> None:
    """``--dataset``, ``--data-dir`` and, where response lengths are counted, ``--served-model``."""
    p.add_argument(
        "--dataset",
        default="mixed",
        help="dataset: 'mixed' (default; alpaca_eval llama-2-7b answers, gsm8k train, code_alpaca, "
        "gpteacher roleplay and toolformer), one source name, 'alpaca_eval:<model>', or a JSONL file "
        "with {prompt, response} or {prompt, length} per line",
    )
    p.add_argument(
        "--data-dir", default=None, help="shared data directory (default $FLEETBATCH_DATA or ../shared/data)"
    )
    if lengths:
        p.add_argument(
            "--served-model", default=None, help="model directory whose tokenizer counts response tokens"
        )


def runtime_args(p: argparse.ArgumentParser) -> None:
    """``--threads``, ``--device`` and ``-v``."""
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: half the cores; on a shared, busy machine 1 is often fastest)",
    )
    p.add_argument("--device", default="cpu", help="torch device (cpu, cuda)")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def model_arg(p: argparse.ArgumentParser, what: str = "model version directory or parent") -> None:
    """``--predictor`` with the default parent directory of versions."""
    p.add_argument("--predictor", default=DEFAULT_OUT, help=f"{what} (default {DEFAULT_OUT})")


def serving_tokenizer(path: str | None):
    """The tokenizer of the model directory ``path``, else the project's default serving tokenizer."""
    if path:
        if not Path(path).is_dir():
            raise FileNotFoundError(f"serving tokenizer directory {path} not found")
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    return default_tokenizer()


def length_tokenizer(args):
    """The ``--served-model`` if given, else None: ``labeled.label`` then loads the default only if
    some record needs its response counted (a JSONL of {prompt, length} lines, e.g. from `fleetbatch predictor
    export`, needs none)."""
    return serving_tokenizer(args.served_model) if args.served_model else None


def splits(args, limit: int | None = None) -> tuple[LabeledSet, dict[str, LabeledSet]]:
    """``--dataset`` labelled and split (train/val/test); ``limit`` subsamples the training split."""
    data = load_labeled(args.dataset, args.data_dir, length_tokenizer(args))
    sp = split(data)
    if limit is not None:
        sp["train"] = sp["train"].sample(limit, args.seed if hasattr(args, "seed") else 0)
    return data, sp


def comma_list(text: str) -> list[str]:
    """Items of a comma-separated option value, stripped, blanks dropped."""
    return [d.strip() for d in text.split(",") if d.strip()]


def rounded(d):
    """``d`` with every float (in nested dicts too) rounded to 4 decimals."""
    if isinstance(d, dict):
        return {k: rounded(v) for k, v in d.items()}
    if isinstance(d, float):
        return round(d, 4)
    return d
