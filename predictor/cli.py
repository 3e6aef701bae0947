"""``predictor`` command line: train, eval, bench and retrain the response-length classifier.

Every subcommand prints, as its last line, one JSON object with its figures.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

log = logging.getLogger("predictor")

DEFAULT_OUT = "runs/predictor"
MICO_GSM8K_ACCURACY = 0.8069
MICO_ALPACA_ACCURACY = 0.8537


def _data_args(p: argparse.ArgumentParser, lengths: bool = True) -> None:
    """``--data``, ``--data-dir`` and, where response lengths are counted, ``--serving-tokenizer``."""
    p.add_argument(
        "--data",
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
            "--serving-tokenizer", default=None, help="model directory whose tokenizer counts response tokens"
        )


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: half the cores; on a shared, busy machine 1 is often fastest)",
    )
    p.add_argument("--device", default="cpu", help="torch device (cpu, cuda)")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="predictor",
        description="Response-length predictor: a DistilBERT classifier over length buckets (MICO), "
        "predicting how many tokens the serving model will answer with. Lengths are counted in the "
        "serving tokenizer (the project's default BPE unless --serving-tokenizer names a model directory).",
    )
    sub = ap.add_subparsers(dest="cmd", required=True)

    t = sub.add_parser(
        "train",
        help="train a new model version",
        description="Train a classifier and save it as DIR/v<N>/ with DIR/latest pointing at it.",
    )
    _data_args(t)
    _common(t)
    t.add_argument(
        "--out", default=DEFAULT_OUT, help=f"parent directory of model versions (default {DEFAULT_OUT})"
    )
    t.add_argument(
        "--quick",
        action="store_true",
        help="64 prompt tokens, 6,000 training examples, no MLM, 2.2-minute cap: 1-3 minutes on 2 CPU cores",
    )
    t.add_argument(
        "--pretrained", default=None, help="local pretrained DistilBERT directory (production path)"
    )
    t.add_argument(
        "--scheme",
        choices=("quantile", "uniform"),
        default="quantile",
        help="bucket edges: training-length quantiles (default) or MICO's uniform l_max/N",
    )
    t.add_argument(
        "--buckets", type=int, default=None, help="number of buckets (default 16 quantile, 10 uniform)"
    )
    t.add_argument(
        "--max-ratio",
        type=float,
        default=None,
        help="quantile scheme: split buckets whose upper/lower edge ratio exceeds this (log-spaced), "
        "so the long tail is not one bucket (default 1.5; 0: no splitting)",
    )
    t.add_argument(
        "--l-max",
        type=float,
        default=None,
        help="l_max of uniform buckets (default: longest training answer)",
    )
    t.add_argument("--layers", type=int, default=None, help="transformer layers (default 2)")
    t.add_argument("--dim", type=int, default=None, help="hidden width (default 128)")
    t.add_argument("--heads", type=int, default=None, help="attention heads (default 4)")
    t.add_argument("--max-len", type=int, default=None, help="prompt tokens kept (default 96; quick 64)")
    t.add_argument(
        "--dropout", type=float, default=0.1, help="dropout of a model built from scratch (default 0.1)"
    )
    t.add_argument("--vocab", type=int, default=None, help="WordPiece vocabulary size (default 6000)")
    t.add_argument(
        "--epochs",
        type=float,
        default=None,
        help="epochs, an upper bound under early stopping (default 6 from scratch, 3 pretrained, 2 quick)",
    )
    t.add_argument("--batch-size", type=int, default=32, help="batch size (default 32)")
    t.add_argument(
        "--lr",
        type=float,
        default=None,
        help="peak learning rate (default 1.5e-3 from scratch, 5e-5 pretrained as in MICO)",
    )
    t.add_argument(
        "--patience", type=int, default=3, help="evaluations without validation improvement before stopping"
    )
    t.add_argument(
        "--log-weight",
        type=float,
        default=1.0,
        help="weight of the log-error term on expected tokens (0: cross-entropy only)",
    )
    t.add_argument(
        "--mlm-epochs",
        type=float,
        default=None,
        help="masked-language-model pre-training epochs on the training prompts before fine-tuning "
        "(from-scratch models only; default 2, quick 0; 0: none)",
    )
    t.add_argument(
        "--extra-train",
        default=None,
        metavar="NAMES",
        help="comma-separated datasets added to the training split only, e.g. 'gsm8k_test,"
        "alpaca_eval:llama-2-13b-chat-hf' (records whose prompt is in the validation or test split "
        "are dropped, so nothing held out leaks in)",
    )
    t.add_argument(
        "--mlm-responses",
        action="store_true",
        help="MLM pre-training reads the training split's recorded responses as well as its prompts "
        "(more in-domain text for the encoder; never validation or test text)",
    )
    t.add_argument(
        "--rank-weight",
        type=float,
        default=0.0,
        help="weight of a pairwise ranking term (RankNet on expected log tokens) in the loss (0: off)",
    )
    t.add_argument(
        "--teacher",
        default=None,
        metavar="DIRS",
        help="comma-separated model directories to distil from: the mean of their bucket probabilities on "
        "each training prompt joins the label in the target (they need the new model's bucket edges: "
        "same data, --scheme, --buckets and --max-ratio). An ensemble's ranking at one model's cost",
    )
    t.add_argument(
        "--teacher-weight",
        type=float,
        default=0.5,
        help="share of the teacher's probabilities in the target, 0 to 1 (default 0.5)",
    )
    t.add_argument(
        "--ordinal-sigma",
        type=float,
        default=1.0,
        help="soft ordinal targets: Gaussian of this width (in buckets) around the true bucket "
        "(default 1.0; 0: hard labels, MICO's plain cross-entropy)",
    )
    t.add_argument(
        "--ema",
        type=float,
        default=0.998,
        help="evaluate and keep an exponential moving average of the weights with this decay per step "
        "(default 0.998; 0: off)",
    )
    t.add_argument(
        "--limit", type=int, default=None, help="subsample the training split to this many examples"
    )
    t.add_argument(
        "--max-minutes", type=float, default=None, help="stop training after about this many minutes"
    )
    t.add_argument(
        "--truncation",
        choices=("head_tail", "head"),
        default="head_tail",
        help="how prompts longer than --max-len are cut: keep both ends (default) or the start",
    )
    t.add_argument("--seed", type=int, default=0)

    e = sub.add_parser(
        "eval",
        help="evaluate a model on a held-out split, with baselines",
        description="Accuracy, within-one, majority guess, Kendall tau and MAE of every point estimate "
        "(expected, median, midpoint; the headline kendall_tau/mae_tokens are those of the estimate the "
        "model declares, chosen on validation data at training time), per-source figures, a confusion-matrix "
        "PNG, and TF-IDF baselines on the same split.",
    )
    _data_args(e)
    _common(e)
    e.add_argument(
        "--model", default=DEFAULT_OUT, help=f"model version directory or parent (default {DEFAULT_OUT})"
    )
    e.add_argument(
        "--split",
        choices=("train", "val", "test", "all"),
        default="test",
        help="which split to score (default test)",
    )
    e.add_argument(
        "--plot", default=None, help="confusion matrix PNG (default <model version>/confusion.png)"
    )
    e.add_argument(
        "--ensemble",
        default=None,
        metavar="DIRS",
        help="comma-separated further model directories with the same bucket edges: evaluate the mean "
        "of their bucket probabilities and --model's (costs one forward pass per model at serving time)",
    )
    e.add_argument("--report", default=None, help="also write the full report JSON here")
    e.add_argument("--no-baselines", action="store_true", help="skip the TF-IDF baselines")

    b = sub.add_parser(
        "bench",
        help="batched inference latency and throughput",
        description="Time batched predictions (the serving path) on real prompts.",
    )
    _data_args(b, lengths=False)
    _common(b)
    b.add_argument(
        "--model", default=None, help="model directory (default: a random model of the --quick size)"
    )
    b.add_argument("--batch-size", type=int, default=64, help="queries per forward pass (default 64)")
    b.add_argument("-n", "--queries", type=int, default=1024, help="queries to time (default 1024)")
    b.add_argument("--warmup", type=int, default=2, help="untimed warm-up batches")

    c = sub.add_parser(
        "choose",
        help="(re)choose a model's declared point estimate on the validation split",
        description="Score the expected, median and midpoint estimates of a model version on the "
        "validation split, pick the declared one by the rule of predictor.evaluation.choose_point_estimate "
        "(lowest validation MAE) and record it in the version's predictor.json and metrics.json. "
        "`predictor train` and `retrain` do this themselves; use it for models saved earlier.",
    )
    _data_args(c)
    _common(c)
    c.add_argument(
        "--model", default=DEFAULT_OUT, help=f"model version directory or parent (default {DEFAULT_OUT})"
    )

    x = sub.add_parser(
        "export",
        help="write a dataset's labels (prompt, length in serving tokens, source, split) as JSONL",
        description="Count response lengths once with the serving tokenizer and write {prompt, length, "
        "source, split} lines: `--data FILE.jsonl` then trains on exactly the same examples and splits "
        "elsewhere (e.g. on an accelerator machine) without the raw data or the tokenizer.",
    )
    _data_args(x)
    _common(x)
    x.add_argument("--out", required=True, help="JSONL file to write")

    r = sub.add_parser(
        "retrain",
        help="fine-tune on observed lengths from Redis plus the original data",
        description="MICO's continuous update: read (prompt, observed length) from the Redis list fb:observed, fine-tune the latest version on them plus the original training data, and save the next version.",
    )
    _data_args(r)
    _common(r)
    r.add_argument(
        "--model", default=DEFAULT_OUT, help=f"parent directory of versions (default {DEFAULT_OUT})"
    )
    r.add_argument("--from-redis", required=True, metavar="URL", help="Redis URL holding fb:observed")
    r.add_argument("--observed-limit", type=int, default=None, help="use only the newest N observations")
    r.add_argument(
        "--original",
        type=int,
        default=4000,
        help="original training examples mixed in (default 4000; 0 for none)",
    )
    r.add_argument("--epochs", type=float, default=1.0)
    r.add_argument("--lr", type=float, default=1e-4)
    r.add_argument("--batch-size", type=int, default=32)
    r.add_argument("--out", default=None, help="where to write the new version (default: the --model parent)")
    r.add_argument("--seed", type=int, default=0)
    from predictor import adapt  # here, not at the top: predictor.adapt imports this module

    a = sub.add_parser("adapt", help="benchmark: retrain from observed lengths of another served model")
    _data_args(a)
    _common(a)
    adapt.add_arguments(a)
    return ap


def _serving_tokenizer(path: str | None):
    if path:
        from transformers import AutoTokenizer

        if not Path(path).is_dir():
            raise FileNotFoundError(f"serving tokenizer directory {path} not found")
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    from localmodels import default_tokenizer

    return default_tokenizer()


def _length_tokenizer(args):
    """The ``--serving-tokenizer`` if given, else None: ``labeled.label`` then loads the default only if
    some record needs its response counted (a JSONL of {prompt, length} lines, e.g. from `predictor
    export`, needs none)."""
    return _serving_tokenizer(args.serving_tokenizer) if args.serving_tokenizer else None


def _splits(args, limit: int | None = None):
    from predictor.labeled import load_labeled, split

    data = load_labeled(args.data, args.data_dir, _length_tokenizer(args))
    sp = split(data)
    if limit is not None:
        sp["train"] = sp["train"].sample(limit, args.seed if hasattr(args, "seed") else 0)
    return data, sp


def _extra_training(args, sp: dict):
    """The ``--extra-train`` datasets, without any prompt of the validation or test split."""
    from predictor.labeled import label, records_for

    held_out = set(sp["val"].prompts) | set(sp["test"].prompts)
    records = []
    for name in _comma_list(args.extra_train):
        got = [r for r in records_for(name, args.data_dir) if r.prompt.strip() and r.prompt not in held_out]
        log.info("extra training data: %d examples from %s", len(got), name)
        records.extend(got)
    if not records:
        raise ValueError(f"--extra-train {args.extra_train!r} gave no examples")
    return label(records, _length_tokenizer(args))


def _training_responses(args, train_prompts: list[str]) -> list[str]:
    """Recorded responses of the training prompts (unlabeled text for MLM pre-training).

    Only prompts actually in the training set count, so ``--limit`` limits these too.
    """
    from predictor.labeled import records_for

    wanted = set(train_prompts)
    texts = [r.response for r in records_for(args.data, args.data_dir) if r.response and r.prompt in wanted]
    log.info("MLM pre-training also reads %d training responses", len(texts))
    return texts


def _check_same_edges(members: list, option: str) -> None:
    """Models whose probabilities are averaged must share the first one's bucket edges."""
    for m in members[1:]:
        if m.buckets.edges != members[0].buckets.edges:
            raise ValueError(f"{option}: {m.path} has other bucket edges than {members[0].path}")


def _mean_probs(members: list, prompts: list[str]) -> np.ndarray:
    """The mean of the members' bucket probabilities on ``prompts``."""
    from predictor.inference import predict_proba

    return np.mean(
        [
            predict_proba(
                m.model, m.tokenizer, prompts, m.max_len, 128, progress=True, truncation=m.truncation
            )
            for m in members
        ],
        axis=0,
    )


def _comma_list(text: str) -> list[str]:
    """Items of a comma-separated option value, stripped, blanks dropped."""
    return [d.strip() for d in text.split(",") if d.strip()]


def _teacher(dirs: str, prompts: list[str], device: str):
    """The ``--teacher`` models' mean probabilities on the training prompts."""
    from predictor import store
    from predictor.pipeline import Teacher

    names = _comma_list(dirs)
    if not names:
        raise ValueError("--teacher names no model directory")
    members = [store.load(d, device) for d in names]
    _check_same_edges(members, "--teacher")
    log.info("distilling from %s on %d training prompts", ", ".join(names), len(prompts))
    return Teacher(
        list(members[0].buckets.edges), _mean_probs(members, prompts), [str(m.path) for m in members]
    )


def cmd_train(args) -> dict:
    from predictor.model import DEFAULT, QUICK, ModelConfig
    from predictor.pipeline import fit, save_version
    from predictor.training import TrainConfig

    base = QUICK if args.quick else DEFAULT
    mc = ModelConfig(
        layers=args.layers or base.layers,
        dim=args.dim or base.dim,
        heads=args.heads or base.heads,
        max_len=args.max_len or base.max_len,
        vocab_size=args.vocab or base.vocab_size,
        dropout=args.dropout,
    )
    limit = args.limit if args.limit is not None else (6000 if args.quick else None)
    n_buckets = args.buckets or (10 if args.scheme == "uniform" else 16)
    if args.pretrained:
        mlm_epochs = 0.0
    else:
        mlm_epochs = args.mlm_epochs if args.mlm_epochs is not None else (0.0 if args.quick else 2.0)
    max_ratio = args.max_ratio if args.max_ratio is not None else 1.5
    max_ratio = max_ratio if args.scheme == "quantile" and max_ratio > 0 else None
    tc = TrainConfig(
        epochs=args.epochs or (2.0 if args.quick else 3.0 if args.pretrained else 6.0),
        batch_size=args.batch_size,
        lr=args.lr or (5e-5 if args.pretrained else 1.5e-3),
        patience=args.patience,
        max_len=mc.max_len,
        seed=args.seed,
        truncation=args.truncation,
        max_minutes=args.max_minutes if args.max_minutes is not None else (2.2 if args.quick else None),
        log_weight=args.log_weight,
        ordinal_sigma=args.ordinal_sigma,
        ema=args.ema,
        rank_weight=args.rank_weight,
        teacher_weight=args.teacher_weight,
    )
    t0 = time.monotonic()
    _, sp = _splits(args, limit)
    if args.extra_train:
        sp["train"] = sp["train"].concat(_extra_training(args, sp))
    teacher = _teacher(args.teacher, sp["train"].prompts, args.device) if args.teacher else None
    val = sp["val"].sample(1000, args.seed) if args.quick else sp["val"]
    log.info("train %d, val %d examples", len(sp["train"]), len(val))
    model, tok, buckets, result = fit(
        sp["train"],
        val,
        args.scheme,
        n_buckets,
        mc,
        tc,
        args.pretrained,
        args.device,
        progress=True,
        l_max=args.l_max,
        mlm_epochs=mlm_epochs,
        max_ratio=max_ratio,
        mlm_extra=(
            _training_responses(args, sp["train"].prompts)
            if args.mlm_responses and not args.pretrained
            else None
        ),
        teacher=teacher,
    )
    extra = {
        "data": args.data,
        "mlm_epochs": mlm_epochs,
        "mlm_responses": bool(args.mlm_responses and not args.pretrained),
        "extra_train": args.extra_train,
        "teacher": None if teacher is None else teacher.sources,
        "max_ratio": max_ratio,
        "model_config": mc.to_dict() if not args.pretrained else {"pretrained": str(args.pretrained)},
        "train_examples": len(sp["train"]),
    }
    vdir = save_version(args.out, model, tok, buckets, result, tc, extra)
    return {
        "model_dir": str(vdir),
        "version": vdir.name,
        "scheme": buckets.scheme,
        "buckets": buckets.n,
        "train_examples": len(sp["train"]),
        "initial_val_loss": round(result.initial_val_loss, 4),
        "best_val_loss": round(result.best_val_loss, 4),
        "steps": result.steps,
        "calibration": round(buckets.calibration, 4),
        "point_estimate": result.point_estimate,
        "val_estimates": _round(result.val_estimates),
        "minutes": round((time.monotonic() - t0) / 60, 2),
    }


def _round(d):
    if isinstance(d, dict):
        return {k: _round(v) for k, v in d.items()}
    if isinstance(d, float):
        return round(d, 4)
    return d


def cmd_eval(args) -> dict:
    from predictor import store
    from predictor.baselines import prompt_length_heuristic, tfidf_logreg, tfidf_ridge
    from predictor.evaluation import (
        classifier_figures,
        confusion,
        mico_figures,
        per_source,
        plot_confusion,
        point_figures,
    )

    loaded = store.load(args.model, args.device)
    data, sp = _splits(args)
    test = data if args.split == "all" else sp[args.split]
    if not len(test):
        raise ValueError(f"the {args.split} split of {args.data} is empty")
    train = sp["train"]
    b = loaded.buckets
    log.info(
        "evaluating %s (%s buckets: %d) on %d %s examples", loaded.path, b.scheme, b.n, len(test), args.split
    )
    members = [loaded] + [store.load(d, args.device) for d in _comma_list(args.ensemble or "")]
    _check_same_edges(members, "--ensemble")
    probs = _mean_probs(members, test.prompts)
    train_labels = b.label(train.lengths)
    point = loaded.point_estimate
    report = classifier_figures(probs, test.lengths, b, train_labels, point)
    report.update(
        {
            "model": str(loaded.path),
            "ensemble": [str(m.path) for m in members[1:]],
            "version": loaded.version,
            "scheme": b.scheme,
            "buckets": b.n,
            "split": args.split,
        }
    )
    report["per_source"] = per_source(probs, test.lengths, test.sources, b, train_labels, point)
    report.update(mico_figures(b, probs, test.lengths, train.lengths, test.sources))
    if "gsm8k" in report["per_source"]:
        report["gsm8k_accuracy"] = report["per_source"]["gsm8k"]["accuracy"]
        report["mico_paper_gsm8k_accuracy"] = MICO_GSM8K_ACCURACY
    heur = prompt_length_heuristic(np.array([len(p.split()) for p in test.prompts]))
    report.update(
        {
            f"fallback_{k}": v
            for k, v in point_figures(heur, test.lengths).items()
            if k in ("kendall_tau", "mae_tokens")
        }
    )
    if not args.no_baselines:
        lr_probs = tfidf_logreg(train.prompts, train_labels, test.prompts, b.n)
        lr = classifier_figures(lr_probs, test.lengths, b, train_labels, point)  # same point estimate
        report.update(
            {f"tfidf_lr_{k}": lr[k] for k in ("accuracy", "within_one", "kendall_tau", "mae_tokens")}
        )
        ridge = point_figures(tfidf_ridge(train.prompts, train.lengths, test.prompts), test.lengths)
        report.update({f"tfidf_ridge_{k}": ridge[k] for k in ("kendall_tau", "mae_tokens", "sum_ratio")})
    shipped = loaded.path.resolve() == store.SHIPPED_DIR  # package data: keep the plot out of it
    plot = (
        Path(args.plot)
        if args.plot
        else Path("runs/shipped-confusion.png" if shipped else loaded.path / "confusion.png")
    )
    cm = confusion(b.label(test.lengths), probs.argmax(1), b.n)
    report["confusion_png"] = str(
        plot_confusion(cm, b, plot, f"{loaded.version}: {b.scheme} buckets, {args.data} {args.split}")
    )
    report["confusion"] = cm.tolist()
    report = _round(report)
    if args.report:
        Path(args.report).parent.mkdir(parents=True, exist_ok=True)
        Path(args.report).write_text(json.dumps(report, indent=2), encoding="utf-8")
    _print_eval(report)
    report.pop("confusion")
    return report


def _print_eval(r: dict) -> None:
    print(f"model {r['model']} ({r['scheme']} buckets: {r['buckets']}), {r['split']} split, n={r['n']}")
    print(
        f"  accuracy {r['accuracy']:.3f}  within one {r['within_one']:.3f}  majority guess {r['majority_accuracy']:.3f}"
    )
    print(
        f"  headline ({r['point_estimate']} tokens, the model's declared point estimate): Kendall tau {r['kendall_tau']:.3f}  MAE {r['mae_tokens']:.1f}"
    )
    for name in ("expected", "median", "midpoint"):
        extra = f"  batch-64 sum error {r['expected_batch64_sum_error']:.3f}" if name == "expected" else ""
        print(
            f"  {name + ' tokens:':16s} Kendall tau {r[name + '_kendall_tau']:.3f}  MAE {r[name + '_mae_tokens']:.1f}  sum ratio {r[name + '_sum_ratio']:.3f}{extra}"
        )
    if "tfidf_ridge_kendall_tau" in r:
        print(
            f"  TF-IDF + logistic regression: accuracy {r['tfidf_lr_accuracy']:.3f}  Kendall tau {r['tfidf_lr_kendall_tau']:.3f}  MAE {r['tfidf_lr_mae_tokens']:.1f}"
        )
        print(
            f"  TF-IDF + ridge (log length):  Kendall tau {r['tfidf_ridge_kendall_tau']:.3f}  MAE {r['tfidf_ridge_mae_tokens']:.1f}"
        )
    print(
        f"  prompt-length heuristic:      Kendall tau {r['fallback_kendall_tau']:.3f}  MAE {r['fallback_mae_tokens']:.1f}"
    )
    for s, f in r["per_source"].items():
        print(
            f"  {s:12s} n={f['n']:5d}  acc {f['accuracy']:.3f}  within one {f['within_one']:.3f}  tau {f['kendall_tau']:.3f}  MAE {f['mae_tokens']:.1f}"
        )
    print(
        f"  MICO's bucketing ({r['mico_buckets']} uniform buckets of {r['mico_l_max'] / r['mico_buckets']:.0f} tokens, "
        f"the model's distribution summed into them): accuracy {r['mico_accuracy']:.3f}  within one "
        f"{r['mico_within_one']:.3f}  majority guess {r['mico_majority_accuracy']:.3f}"
    )
    if "mico_gsm8k_accuracy" in r:
        print(
            f"  gsm8k with MICO's bucketing: accuracy {r['mico_gsm8k_accuracy']:.3f}, majority guess "
            f"{r['mico_gsm8k_majority_accuracy']:.3f} (MICO reports {MICO_GSM8K_ACCURACY:.4f})"
        )
    print(f"  confusion matrix: {r['confusion_png']}")


def cmd_bench(args) -> dict:
    import torch

    from predictor import store
    from predictor.labeled import records_for
    from predictor.serving import LengthPredictor

    if args.batch_size < 1 or args.queries < 1:
        raise ValueError("--batch-size and --queries must be positive")
    if args.model:
        predictor = LengthPredictor(
            store.load(args.model, args.device), Path(args.model), max_batch=args.batch_size
        )
    else:
        from predictor.buckets import quantile_buckets
        from predictor.model import QUICK, build_classifier, train_wordpiece
        from predictor.store import LoadedModel

        log.info("no --model: timing a random model of the --quick size")
        prompts = [r.prompt for r in records_for(args.data, args.data_dir)]
        tok = train_wordpiece(prompts[:5000], QUICK.vocab_size)
        buckets = quantile_buckets(np.arange(1, 1000), 16)
        model = build_classifier(QUICK, tok, buckets.n).to(args.device).eval()
        loaded = LoadedModel(model, tok, buckets, {"version": "random", "max_len": QUICK.max_len}, Path("."))
        predictor = LengthPredictor(loaded, None, max_batch=args.batch_size)
    prompts = [r.prompt for r in records_for(args.data, args.data_dir)]
    rng = np.random.default_rng(0)
    prompts = [
        prompts[i] for i in rng.choice(len(prompts), size=min(args.queries, len(prompts)), replace=False)
    ]
    batches = [prompts[i : i + args.batch_size] for i in range(0, len(prompts), args.batch_size)]
    for bt in batches[: args.warmup]:
        predictor.predict(bt)
    times = []
    from tqdm import tqdm

    for bt in tqdm(batches, desc="bench", unit="batch"):
        t = time.perf_counter()
        predictor.predict(bt)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    single = []
    for p in prompts[:32]:
        t = time.perf_counter()
        predictor.predict([p])
        single.append(time.perf_counter() - t)
    total = sum(times)
    out = {
        "model": predictor.version,
        "device": args.device,
        "threads": torch.get_num_threads(),
        "batch_size": args.batch_size,
        "queries": len(prompts),
        "ms_per_query": round(1000 * total / len(prompts), 3),
        "queries_per_s": round(len(prompts) / total, 1),
        "batch_ms_p50": round(1000 * float(np.median(times)), 2),
        "batch_ms_p90": round(1000 * float(np.percentile(times, 90)), 2),
        "single_query_ms_p50": round(1000 * float(np.median(single)), 2),
    }
    print(
        f"{out['ms_per_query']} ms per query at batch {args.batch_size} ({out['queries_per_s']} queries/s); one query alone {out['single_query_ms_p50']} ms"
    )
    return out


def cmd_retrain(args) -> dict:
    from predictor import store
    from predictor.labeled import label
    from predictor.observed import read_observed
    from predictor.pipeline import retrain, save_version
    from predictor.training import TrainConfig

    loaded = store.load(args.model, args.device)
    observed = read_observed(args.from_redis, args.observed_limit)
    if not observed:
        raise ValueError(f"no observed lengths in Redis at {args.from_redis}; nothing to retrain on")
    obs = label(observed, _serving_tokenizer(args.serving_tokenizer))
    _, sp = _splits(args)
    original = sp["train"].sample(args.original, args.seed) if args.original else None
    train_set = obs if original is None else original.concat(obs)
    base = loaded.meta.get("train_config", {})
    tc = replace(
        TrainConfig(),
        epochs=args.epochs,
        lr=args.lr,
        batch_size=args.batch_size,
        max_len=loaded.max_len,
        truncation=loaded.truncation,
        seed=args.seed,
        log_weight=float(base.get("log_weight", 1.0)),
        ordinal_sigma=float(base.get("ordinal_sigma", 0.0)),
        warmup=0.0,
    )
    log.info(
        "retraining %s on %d observed + %d original examples",
        loaded.path,
        len(obs),
        len(train_set) - len(obs),
    )
    buckets, result = retrain(loaded, train_set, sp["val"], tc)
    out = (
        Path(args.out)
        if args.out
        else (Path(args.model).parent if store.is_version_dir(args.model) else Path(args.model))
    )
    extra = {
        **{k: v for k, v in loaded.meta.items() if k not in ("version", "created", "train_config")},
        "retrained_from": str(loaded.path),
        "observed_examples": len(obs),
        "original_examples": len(train_set) - len(obs),
    }
    vdir = save_version(out, loaded.model, loaded.tokenizer, buckets, result, tc, extra)
    return {
        "model_dir": str(vdir),
        "version": vdir.name,
        "retrained_from": loaded.version,
        "observed_examples": len(obs),
        "original_examples": len(train_set) - len(obs),
        "initial_val_loss": round(result.initial_val_loss, 4),
        "best_val_loss": round(result.best_val_loss, 4),
        "steps": result.steps,
        "point_estimate": result.point_estimate,
    }


def cmd_adapt(args) -> dict:
    from predictor import adapt

    return adapt.run(args)


def cmd_choose(args) -> dict:
    from predictor import store
    from predictor.inference import predict_proba
    from predictor.pipeline import choose_estimate
    from predictor.training import TrainResult

    loaded = store.load(args.model, args.device)
    _, sp = _splits(args)
    val = sp["val"]
    if not len(val):
        raise ValueError(f"the validation split of {args.data} is empty")
    probs = predict_proba(
        loaded.model, loaded.tokenizer, val.prompts, loaded.max_len, 128, truncation=loaded.truncation
    )
    result = TrainResult()
    choose_estimate(loaded.buckets, probs, val.lengths, result)
    meta_path = loaded.path / store.META_FILE
    meta = json.loads(meta_path.read_text(encoding="utf-8")) if meta_path.is_file() else {}
    meta["point_estimate"] = result.point_estimate
    tmp = meta_path.with_name(meta_path.name + ".tmp")
    tmp.write_text(json.dumps(meta, indent=2), encoding="utf-8")
    os.replace(tmp, meta_path)
    metrics = store.read_metrics(loaded.path)
    metrics.update({"point_estimate": result.point_estimate, "val_estimates": result.val_estimates})
    store.write_metrics(loaded.path, metrics)
    return {
        "model": str(loaded.path),
        "previous": loaded.point_estimate,
        "point_estimate": result.point_estimate,
        "val_estimates": _round(result.val_estimates),
    }


def cmd_export(args) -> dict:
    from predictor.labeled import split_of

    data, sp = _splits(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as f:
        for p, n, s in zip(data.prompts, data.lengths, data.sources, strict=True):
            f.write(json.dumps({"prompt": p, "length": int(n), "source": s, "split": split_of(p)}) + "\n")
    return {"out": str(out), "examples": len(data), **{k: len(v) for k, v in sp.items()}}


COMMANDS = {
    "train": cmd_train,
    "eval": cmd_eval,
    "bench": cmd_bench,
    "choose": cmd_choose,
    "export": cmd_export,
    "retrain": cmd_retrain,
    "adapt": cmd_adapt,
}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    for noisy in ("transformers", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    try:
        import torch

        threads = args.threads if args.threads is not None else max(1, (os.cpu_count() or 2) // 2)
        if threads < 1:
            raise ValueError("--threads must be at least 1")
        torch.set_num_threads(threads)
        result = COMMANDS[args.cmd](args)
    except (FileNotFoundError, ValueError, ConnectionError, OSError) as e:
        print(f"predictor {args.cmd}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("predictor: interrupted", file=sys.stderr)
        return 130
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
