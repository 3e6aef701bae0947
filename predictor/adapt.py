"""``fleetbatch predictor adapt``: does retraining on observed lengths adapt the predictor to the served model?

A benchmark that plays a deployment whose served model answers differently from the data the
predictor was trained on (issue 16, item 3):

1. the "before" model (default: the shipped one, trained on the mixed workload with the
   ``llama-2-7b-chat-hf`` alpaca_eval answers) predicts the prompts of another, more verbose
   model (default ``alpaca_eval:Meta-Llama-3-8B-Instruct``), whose lengths it never saw;
2. those prompts are split (seeded) into an *observed* part and a *held-out* part;
3. the observed part's (prompt, true length) pairs are written to a real Redis exactly as the
   engines do it: ``WorkQueue.record_observed`` (``engines/worker.py``), onto ``fb:observed``,
   with the before-model's estimate as ``predicted``;
4. ``fleetbatch predictor retrain --redis-url`` runs on it: its own option declarations and ``run``
   (:mod:`predictor.commands.retrain`);
5. Kendall tau, MAE (of each model's declared point estimate) and the predicted/true sum
   ratio (of the calibrated expectation, what the gateway adds up) are scored on the held-out
   prompts before and after, with the original workload's test split beside them.

Lengths are in the serving tokenizer's tokens (``localmodels.default_tokenizer`` unless
``--served-model``), the same counting as ``fleetbatch predictor train``.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
from pathlib import Path

import numpy as np

from predictor import store
from predictor.commands import retrain
from predictor.commands.common import serving_tokenizer
from predictor.evaluation import estimates, point_figures
from predictor.labeled import LabeledSet, label, load_labeled, records_for, split
from workqueue.embedded import EmbeddedRedis
from workqueue.queue import WorkQueue
from workqueue.records import Observation

log = logging.getLogger(__name__)

DEFAULT_SERVED = "alpaca_eval:Meta-Llama-3-8B-Instruct"
#: the alpaca_eval answers the named training datasets hold (see fleetdata.datasets.load_source)
_DEFAULT_ALPACA = "llama-2-7b-chat-hf"
CLUSTER = "adapt"  # the cluster name written with each observation
FLUSH = 32  # observations per record_observed call, as a worker's flush writes them
RETRAIN_DATA = ("relabeled", "original")
ORIGINAL_SET = "original test (others)"  # --dataset's test split without the served prompts


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``adapt`` options (the CLI adds ``--dataset``, ``--data-dir``, ``--served-model``,
    ``--threads``, ``--device`` and ``-v``: ``--dataset`` is the original training data)."""
    p.add_argument("--predictor", default=store.SHIPPED_NAME, help="the 'before' model (default: shipped)")
    p.add_argument(
        "--served",
        default=DEFAULT_SERVED,
        help="what the served model answers: an alpaca_eval model name, 'alpaca_eval:<model>' or a "
        f"JSONL file; must not be in the model's training data (default {DEFAULT_SERVED})",
    )
    p.add_argument(
        "--observed-fraction",
        type=float,
        default=0.5,
        help="share of the served prompts whose lengths are observed (default 0.5; the rest is held out)",
    )
    p.add_argument(
        "--redis-url",
        default=None,
        help="Redis to record in (default: an embedded one in a temp dir); the observations stay in its "
        "fb:observed, and retrain reads only the newest ones, these",
    )
    p.add_argument(
        "--original", type=int, default=2000, help="retrain: original examples mixed in (default 2000)"
    )
    p.add_argument("--epochs", type=float, default=3.0, help="retrain: epochs (default 3)")
    p.add_argument("--lr", type=float, default=3e-4, help="retrain: learning rate (default 3e-4)")
    p.add_argument("--batch-size", type=int, default=32, help="retrain: batch size (default 32)")
    p.add_argument("--out", default=None, help="where retrain writes its version (default: a temp dir)")
    p.add_argument("--seed", type=int, default=0, help="observed/held-out split and retrain seed")
    p.add_argument(
        "--retrain-data",
        choices=RETRAIN_DATA,
        default="relabeled",
        help="retrain's --dataset: 'original' (--dataset as is: its stale labels of the served prompts stay, and "
        "its validation split, which early stopping and calibration use, knows nothing of the served "
        "model) or 'relabeled' (default: a labels JSONL of --dataset with every served prompt's stale record "
        "replaced by the observations; held-out prompts appear in neither)",
    )
    p.add_argument(
        "--relabel-original",
        type=int,
        default=2000,
        metavar="K",
        help="relabeled data: keep a seeded sample of K original examples beside the observations (default "
        "2000; -1: all; this sets how much of retrain's validation split, its early-stopping gate, is the served model)",
    )
    p.add_argument(
        "--no-original-eval",
        action="store_true",
        help="skip scoring the original data's test split before and after",
    )


def served_name(served: str) -> str:
    """``--served`` as a dataset name: a bare alpaca_eval model name becomes ``alpaca_eval:<model>``."""
    if ":" in served or served.endswith(".jsonl") or Path(served).is_file():
        return served
    return f"alpaca_eval:{served}"


def trained_alpaca_models(meta: dict) -> set[str]:
    """The alpaca_eval models whose answers a model's training data held (``data`` and ``extra_train``)."""
    names = [str(meta.get("data") or "")] + str(meta.get("extra_train") or "").split(",")
    out = set()
    for n in (x.strip() for x in names):
        if n in ("mixed", "alpaca_eval"):
            out.add(_DEFAULT_ALPACA)
        elif n.startswith("alpaca_eval:"):
            out.add(n.split(":", 1)[1])
    return out


def split_observed(data: LabeledSet, fraction: float, seed: int) -> tuple[LabeledSet, LabeledSet]:
    """A seeded (observed, held-out) split of the served prompts; duplicate prompts stay on one side."""
    if not 0 < fraction < 1:
        raise ValueError(f"--observed-fraction must be in (0, 1), not {fraction}")
    uniq = sorted(set(data.prompts))
    rng = np.random.default_rng(seed)
    chosen = set(rng.permutation(len(uniq))[: int(round(fraction * len(uniq)))].tolist())
    observed = {p for i, p in enumerate(uniq) if i in chosen}
    obs = [i for i, p in enumerate(data.prompts) if p in observed]
    held = [i for i, p in enumerate(data.prompts) if p not in observed]
    if not obs or not held:
        raise ValueError(f"{len(data)} served prompts are too few to split into observed and held-out")
    return data.subset(obs), data.subset(held)


def score(loaded: store.LoadedModel, data: LabeledSet) -> dict:
    """Tau and MAE of the model's declared estimate; sum ratio of its calibrated expectation."""
    probs = loaded.predict_proba(data.prompts)
    est = estimates(loaded.buckets, probs)
    point = point_figures(est[loaded.point_estimate], data.lengths)
    expected = est["expected"]
    return {
        "n": len(data),
        "point_estimate": loaded.point_estimate,
        "tau": point["kendall_tau"],
        "mae": point["mae_tokens"],
        "expected_tau": point_figures(expected, data.lengths)["kendall_tau"],
        "sum_ratio": float(expected.sum() / max(1.0, float(np.sum(data.lengths)))),
        "mean_pred": float(expected.mean()),
        "mean_true": float(np.mean(data.lengths)),
        "expected": expected,
    }


def record(url: str, observed: LabeledSet, predicted: np.ndarray, source: str) -> int:
    """Write the observations as the engines do (``WorkQueue.record_observed``, in flush-sized chunks)."""
    queue = WorkQueue.from_url(url)
    rows = [
        Observation(p, int(n), source, CLUSTER, float(e))
        for p, n, e in zip(observed.prompts, observed.lengths, predicted, strict=True)
    ]
    try:
        for start in range(0, len(rows), FLUSH):
            queue.record_observed(rows[start : start + FLUSH])
    finally:
        queue.r.close()
    return len(rows)


def relabeled(
    original: LabeledSet, served: LabeledSet, observed: LabeledSet, path: Path, keep_n: int | None, seed: int
) -> Path:
    """Write the original labels without any served prompt (a seeded sample of ``keep_n`` of them when
    given), plus the observations, as a labels JSONL (the format of ``fleetbatch predictor export``)."""
    drop = set(served.prompts)
    keep = original.subset([i for i, p in enumerate(original.prompts) if p not in drop]).sample(keep_n, seed)
    data = keep.concat(LabeledSet(observed.prompts, observed.lengths, ["observed"] * len(observed)))
    with path.open("w", encoding="utf-8") as f:
        for p, n, s in zip(data.prompts, data.lengths, data.sources, strict=True):
            f.write(json.dumps({"prompt": p, "length": int(n), "source": s}) + "\n")
    log.info("relabeled data: %d original examples, %d observed", len(keep), len(observed))
    return path


def retrain_argv(args: argparse.Namespace, url: str, out: str, n_observed: int, data: str) -> list[str]:
    """The ``fleetbatch predictor retrain`` command line this benchmark runs."""
    argv = ["retrain", "--predictor", str(args.predictor), "--redis-url", url, "--out", out]
    argv += ["--observed-limit", str(n_observed), "--dataset", data]
    argv += ["--original", str(args.original), "--epochs", str(args.epochs), "--lr", str(args.lr)]
    argv += ["--batch-size", str(args.batch_size), "--seed", str(args.seed), "--device", args.device]
    if args.data_dir:
        argv += ["--data-dir", args.data_dir]
    if args.served_model:
        argv += ["--served-model", args.served_model]
    return argv


def _row(name: str, model: str, s: dict) -> str:
    return (
        f"{name:<22} {model:<7} {s['n']:>6} {s['point_estimate']:>8} {s['tau']:>6.3f} {s['mae']:>7.1f} "
        f"{s['sum_ratio']:>6.3f} {s['mean_pred']:>9.1f} {s['mean_true']:>9.1f}"
    )


def print_table(served: str, sets: dict[str, tuple[dict, dict]]) -> None:
    print(f"fleetbatch predictor adapt: served model {served}")
    print(
        f"{'set':<22} {'model':<7} {'n':>6} {'estimate':>8} {'tau':>6} {'MAE':>7} {'sum':>6} "
        f"{'mean pred':>9} {'mean true':>9}"
    )
    for name, (before, after) in sets.items():
        print(_row(name, "before", before))
        print(_row(name, "after", after))


def _public(s: dict) -> dict:
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in s.items() if k != "expected"}


def run(args: argparse.Namespace) -> dict:
    """The benchmark; prints the table and returns the JSON summary (``predictor`` prints it last)."""
    served = served_name(args.served)
    before = store.load(args.predictor, args.device)
    trained = set().union(*(trained_alpaca_models(m.meta) for m in before.parts))  # an ensemble: any member's
    if served.startswith("alpaca_eval:") and served.split(":", 1)[1] in trained:
        raise ValueError(f"{served} was in {before.path}'s training data; serve another model")
    tokenizer = serving_tokenizer(args.served_model)
    data = label(records_for(served, args.data_dir), tokenizer)
    observed, held_out = split_observed(data, args.observed_fraction, args.seed)
    log.info("served %s: %d observed, %d held out", served, len(observed), len(held_out))
    held_before = score(before, held_out)
    obs_before = score(before, observed)
    original = None
    if args.retrain_data == "relabeled" or not args.no_original_eval:
        original = load_labeled(args.dataset, args.data_dir, tokenizer)
    original_test = None
    if not args.no_original_eval:
        test = split(original)["test"]
        served_prompts = set(data.prompts)
        original_test = test.subset([i for i, p in enumerate(test.prompts) if p not in served_prompts])
        orig_before = score(before, original_test)

    with tempfile.TemporaryDirectory(prefix="fleetbatch-adapt-") as tmp:
        server = None if args.redis_url else EmbeddedRedis(Path(tmp) / "redis", persist=False)
        try:
            url = args.redis_url or server.url
            n = record(url, observed, obs_before["expected"], f"served:{served}")
            retrain_data = args.dataset
            if args.retrain_data == "relabeled":
                path = Path(tmp) / "relabeled.jsonl"
                keep = None if args.relabel_original < 0 else args.relabel_original
                relabeled(original, data, observed, path, keep, args.seed)
                retrain_data = str(path)
            argv = retrain_argv(args, url, args.out or str(Path(tmp) / "model"), n, retrain_data)
            log.info("predictor %s", " ".join(argv))
            retrained = retrain.run(retrain.parser().parse_args(argv[1:]))
        finally:
            if server is not None:
                server.close()
        after = store.load(retrained["model_dir"], args.device)
        held_after = score(after, held_out)
        obs_after = score(after, observed)
        sets = {"served held-out": (held_before, held_after), "served observed": (obs_before, obs_after)}
        if original_test is not None:
            sets[ORIGINAL_SET] = (orig_before, score(after, original_test))

    print_table(served, sets)
    result = {
        "trained_on": before.meta.get("data"),
        "trained_alpaca_eval": sorted(trained),
        "before_model": str(before.path),
        "after_model": retrained["model_dir"] if args.out else None,
        "served": served,
        "observed": len(observed),
        "held_out": len(held_out),
        "retrain_data": args.retrain_data,
        "relabel_original": args.relabel_original,
        "original": retrained["original_examples"],
        "epochs": args.epochs,
        "lr": args.lr,
        "seed": args.seed,
        "tau_before": round(held_before["tau"], 4),
        "tau_after": round(held_after["tau"], 4),
        "mae_before": round(held_before["mae"], 2),
        "mae_after": round(held_after["mae"], 2),
        "sum_ratio_before": round(held_before["sum_ratio"], 4),
        "sum_ratio_after": round(held_after["sum_ratio"], 4),
        "estimate_before": held_before["point_estimate"],
        "estimate_after": held_after["point_estimate"],
        "held_out_before": _public(held_before),
        "held_out_after": _public(held_after),
        "retrain": retrained,
    }
    if original_test is not None:
        result["original_test_before"] = _public(sets[ORIGINAL_SET][0])
        result["original_test_after"] = _public(sets[ORIGINAL_SET][1])
    result["goal_met"] = bool(
        0.9 <= held_after["sum_ratio"] <= 1.1 and held_after["tau"] >= held_before["tau"]
    )
    return result
