"""``fleetbatch predictor eval``: score a model (or an ensemble) on a held-out split, with baselines, per-source
figures, MICO's bucketing and a confusion-matrix plot."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import numpy as np

from predictor import ensemble, leave_one_out, store
from predictor.baselines import prompt_length_heuristic, tfidf_logreg, tfidf_ridge
from predictor.commands.common import comma_list, model_arg, rounded, splits
from predictor.evaluation import (
    classifier_figures,
    confusion,
    mico_figures,
    per_source,
    plot_confusion,
    point_figures,
)

log = logging.getLogger("predictor")

MICO_GSM8K_ACCURACY = 0.8069


def add_arguments(p: argparse.ArgumentParser) -> None:
    model_arg(p)
    p.add_argument(
        "--split",
        choices=("train", "val", "test", "all"),
        default="test",
        help="which split to score (default test)",
    )
    p.add_argument(
        "--plot", default=None, help="confusion matrix PNG (default <model version>/confusion.png)"
    )
    p.add_argument(
        "--ensemble",
        default=None,
        metavar="DIRS",
        help="comma-separated further model directories with the same bucket edges: evaluate the mean "
        "of their bucket probabilities and --predictor's (costs one forward pass per model at serving time)",
    )
    p.add_argument("--report", default=None, help="also write the full report JSON here")
    p.add_argument("--no-baselines", action="store_true", help="skip the TF-IDF baselines")
    leave_one_out.add_arguments(p)


def run(args) -> dict:
    if args.leave_one_model_out:
        return leave_one_out.run(args)
    loaded = store.load(args.predictor, args.device)
    data, sp = splits(args)
    test = data if args.split == "all" else sp[args.split]
    if not len(test):
        raise ValueError(f"the {args.split} split of {args.dataset} is empty")
    train = sp["train"]
    b = loaded.buckets
    log.info(
        "evaluating %s (%s buckets: %d) on %d %s examples", loaded.path, b.scheme, b.n, len(test), args.split
    )
    members = [loaded] + [store.load(d, args.device) for d in comma_list(args.ensemble or "")]
    store.check_same_edges(members, "--ensemble")
    probs = ensemble.mean_probs(members, test.prompts)
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
        plot_confusion(cm, b, plot, f"{loaded.version}: {b.scheme} buckets, {args.dataset} {args.split}")
    )
    report["confusion"] = cm.tolist()
    report = rounded(report)
    if args.report:
        Path(args.report).parent.mkdir(parents=True, exist_ok=True)
        Path(args.report).write_text(json.dumps(report, indent=2), encoding="utf-8")
    print_report(report)
    report.pop("confusion")
    return report


def print_report(r: dict) -> None:
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
