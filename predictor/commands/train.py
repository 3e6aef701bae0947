"""``fleetbatch predictor train``: train a new model version (from scratch, from a local pretrained encoder, or
distilled from teachers) and save it as ``OUT/v<N>/``."""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from predictor import ensemble, metadata
from predictor.augment import augment
from predictor.commands.common import DEFAULT_OUT, comma_list, length_tokenizer, rounded, splits
from predictor.labeled import LabeledSet, label, records_for
from predictor.model import DEFAULT, QUICK, ModelConfig
from predictor.pipeline import fit, save_version
from predictor.training import TrainConfig

log = logging.getLogger("predictor")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--out", default=DEFAULT_OUT, help=f"parent directory of model versions (default {DEFAULT_OUT})"
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="64 prompt tokens, 6,000 training examples, no MLM, a 2.2-minute cap (then the next evaluation)",
    )
    p.add_argument(
        "--pretrained",
        default=None,
        metavar="DIR",
        help="fine-tune a local Hugging Face encoder checkpoint (BERT, DistilBERT, MiniLM, ...: read with "
        "AutoModel and AutoTokenizer, local files only) under a mean-pooled bucket head, instead of "
        "building a model; `fleetbatch predictor pretrained minilm --out DIR` unpacks all-MiniLM-L6-v2",
    )
    p.add_argument(
        "--scheme",
        choices=("quantile", "uniform"),
        default="quantile",
        help="bucket edges: training-length quantiles (default) or MICO's uniform l_max/N",
    )
    p.add_argument(
        "--buckets", type=int, default=None, help="number of buckets (default 16 quantile, 10 uniform)"
    )
    p.add_argument(
        "--max-ratio",
        type=float,
        default=None,
        help="quantile scheme: split buckets whose upper/lower edge ratio exceeds this (log-spaced), "
        "so the long tail is not one bucket (default 1.5; 0: no splitting)",
    )
    p.add_argument(
        "--l-max",
        type=float,
        default=None,
        help="l_max of uniform buckets (default: longest training answer)",
    )
    p.add_argument("--layers", type=int, default=None, help="transformer layers (default 2)")
    p.add_argument("--dim", type=int, default=None, help="hidden width (default 128)")
    p.add_argument("--heads", type=int, default=None, help="attention heads (default 4)")
    p.add_argument("--max-len", type=int, default=None, help="prompt tokens kept (default 96; quick 64)")
    p.add_argument(
        "--dropout", type=float, default=0.1, help="dropout of a model built from scratch (default 0.1)"
    )
    p.add_argument("--vocab", type=int, default=None, help="WordPiece vocabulary size (default 6000)")
    p.add_argument(
        "--epochs",
        type=float,
        default=None,
        help="epochs, an upper bound under early stopping (default 6 from scratch, 3 pretrained, 2 quick)",
    )
    p.add_argument("--batch-size", type=int, default=32, help="batch size (default 32)")
    p.add_argument(
        "--lr",
        type=float,
        default=None,
        help="peak learning rate (default 1.5e-3 from scratch, 5e-5 pretrained as in MICO)",
    )
    p.add_argument(
        "--patience", type=int, default=3, help="evaluations without validation improvement before stopping"
    )
    p.add_argument(
        "--log-weight",
        type=float,
        default=1.0,
        help="weight of the log-error term on expected tokens (0: cross-entropy only)",
    )
    p.add_argument(
        "--mlm-epochs",
        type=float,
        default=None,
        help="masked-language-model pre-training epochs on the training prompts before fine-tuning "
        "(from-scratch models only; default 2, quick 0; 0: none)",
    )
    p.add_argument(
        "--extra-train",
        default=None,
        metavar="NAMES",
        help="comma-separated datasets added to the training split only, e.g. 'gsm8k_test,"
        "alpaca_eval:llama-2-13b-chat-hf' (records whose prompt is in the validation or test split "
        "are dropped, so nothing held out leaks in)",
    )
    p.add_argument(
        "--mlm-responses",
        action="store_true",
        help="MLM pre-training reads the training split's recorded responses as well as its prompts "
        "(more in-domain text for the encoder; never validation or test text)",
    )
    p.add_argument(
        "--rank-weight",
        type=float,
        default=0.0,
        help="weight of a pairwise ranking term (RankNet on expected log tokens) in the loss (0: off)",
    )
    p.add_argument(
        "--teacher",
        default=None,
        metavar="DIRS",
        help="comma-separated model directories to distil from: the mean of their bucket probabilities on "
        "each training prompt joins the label in the target (they need the new model's bucket edges: "
        "same data, --scheme, --buckets and --max-ratio). An ensemble's ranking at one model's cost",
    )
    p.add_argument(
        "--augment",
        type=int,
        default=0,
        metavar="K",
        help="with --teacher: K noisy copies of each training prompt (words dropped, a span cut), "
        "labelled by the teacher, join the training examples (default 0: none)",
    )
    p.add_argument(
        "--augment-seed",
        type=int,
        default=None,
        metavar="N",
        help="seed of the --augment copies (default: --seed). Fixing it while --seed varies keeps the "
        "copies, so --teacher-cache still hits and only the student's own randomness changes",
    )
    p.add_argument(
        "--teacher-cache",
        type=Path,
        default=None,
        metavar="DIR",
        help="with --teacher: keep each teacher's outputs on the training prompts (and --augment copies) "
        "in DIR, and read them back in later runs with the same teacher, data and seed instead of "
        "running the teacher again (default: not kept)",
    )
    p.add_argument(
        "--teacher-weight",
        type=float,
        default=0.5,
        help="share of the teacher's probabilities in the target, 0 to 1 (default 0.5)",
    )
    p.add_argument(
        "--feature-weight",
        type=float,
        default=0.0,
        help="with --teacher: weight of feature distillation, the student's pooled vector mapped onto "
        "the teacher's (mean squared error, per-dimension standardised; default 0: off)",
    )
    p.add_argument(
        "--ordinal-sigma",
        type=float,
        default=1.0,
        help="soft ordinal targets: Gaussian of this width (in buckets) around the true bucket "
        "(default 1.0; 0: hard labels, MICO's plain cross-entropy)",
    )
    p.add_argument(
        "--ema",
        type=float,
        default=0.998,
        help="evaluate and keep an exponential moving average of the weights with this decay per step "
        "(default 0.998; 0: off)",
    )
    p.add_argument(
        "--limit", type=int, default=None, help="subsample the training split to this many examples"
    )
    p.add_argument(
        "--max-minutes",
        type=float,
        default=None,
        help="stop training at the first evaluation after this many minutes",
    )
    p.add_argument(
        "--truncation",
        choices=("head_tail", "head"),
        default="head_tail",
        help="how prompts longer than --max-len are cut: keep both ends (default) or the start",
    )
    p.add_argument(
        "--checkpoint",
        default=None,
        metavar="FILE",
        help="save the training state here at every evaluation, and resume from it when it exists "
        "(run the same command again, e.g. after --max-minutes stopped it); removed when training ends",
    )
    p.add_argument("--seed", type=int, default=0)


def extra_training(args, sp: dict[str, LabeledSet]) -> LabeledSet:
    """The ``--extra-train`` datasets, without any prompt of the validation or test split."""
    held_out = set(sp["val"].prompts) | set(sp["test"].prompts)
    records = []
    for name in comma_list(args.extra_train):
        got = [r for r in records_for(name, args.data_dir) if r.prompt.strip() and r.prompt not in held_out]
        log.info("extra training data: %d examples from %s", len(got), name)
        records.extend(got)
    if not records:
        raise ValueError(f"--extra-train {args.extra_train!r} gave no examples")
    return label(records, length_tokenizer(args))


def training_responses(args, train_prompts: list[str]) -> list[str]:
    """Recorded responses of the training prompts (unlabeled text for MLM pre-training).

    Only prompts actually in the training set count, so ``--limit`` limits these too.
    """
    wanted = set(train_prompts)
    texts = [
        r.response for r in records_for(args.dataset, args.data_dir) if r.response and r.prompt in wanted
    ]
    log.info("MLM pre-training also reads %d training responses", len(texts))
    return texts


def run(args) -> dict:
    if args.augment and not args.teacher:
        raise ValueError("--augment needs --teacher: the copies are labelled by the teacher")
    if args.augment_seed is not None and not args.augment:
        raise ValueError("--augment-seed needs --augment: it seeds the noisy copies")
    if args.augment_seed is None:  # resolved once: the copies and predictor.json read it
        args.augment_seed = args.seed
    if args.teacher_cache and not args.teacher:
        raise ValueError("--teacher-cache needs --teacher")
    if args.feature_weight and not args.teacher:
        raise ValueError("--feature-weight needs --teacher: it distils the teacher's pooled vectors")
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
        feature_weight=args.feature_weight,
    )
    t0 = time.monotonic()
    _, sp = splits(args, limit)
    if args.extra_train:
        sp["train"] = sp["train"].concat(extra_training(args, sp))
    copies = augment(sp["train"], args.augment, args.augment_seed) if args.augment else None
    if copies is not None:
        log.info("%d noisy copies of training prompts join the training examples", len(copies))
    teacher = (
        ensemble.teacher(
            comma_list(args.teacher),
            sp["train"].prompts + ([] if copies is None else copies.prompts),
            args.device,
            features=args.feature_weight > 0,
            cache=args.teacher_cache,
        )
        if args.teacher
        else None
    )
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
            training_responses(args, sp["train"].prompts)
            if args.mlm_responses and not args.pretrained
            else None
        ),
        teacher=teacher,
        checkpoint=args.checkpoint,
        augmented=copies,
    )
    extra = metadata.train_extra(
        args,
        (
            mc.to_dict()
            if not args.pretrained
            else {
                "pretrained": str(args.pretrained),
                "model_type": model.config.model_type,
                "pooling": "mean",
            }
        ),
        mlm_epochs,
        None if teacher is None else teacher.sources,
        max_ratio,
        len(sp["train"]),
    )
    vdir = save_version(args.out, model, tok, buckets, result, tc, extra)
    return {
        "model_dir": str(vdir),
        "version": vdir.name,
        "scheme": buckets.scheme,
        "buckets": buckets.n,
        "train_examples": len(sp["train"]),
        "augmented_examples": 0 if copies is None else len(copies),
        "initial_val_loss": round(result.initial_val_loss, 4),
        "best_val_loss": round(result.best_val_loss, 4),
        "steps": result.steps,
        "calibration": round(buckets.calibration, 4),
        "point_estimate": result.point_estimate,
        "val_estimates": rounded(result.val_estimates),
        "minutes": round((time.monotonic() - t0) / 60, 2),
    }
