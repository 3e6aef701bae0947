"""``fleetbatch predictor bench``: time batched predictions (the serving path) on real prompts; with
``--compare``, the model's torch members and its fast path (:mod:`predictor.fastpath`) side by side on
the same prompts, and both scored on the test and validation splits."""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from predictor import fast_build, store
from predictor.buckets import quantile_buckets
from predictor.labeled import records_for
from predictor.model import QUICK, build_classifier, train_wordpiece
from predictor.serving import LengthPredictor

log = logging.getLogger("predictor")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--predictor", default=None, help="model directory (default: a random model of the --quick size)"
    )
    p.add_argument("--batch-size", type=int, default=64, help="queries per forward pass (default 64)")
    p.add_argument("-n", "--num-queries", type=int, default=1024, help="queries to time (default 1024)")
    p.add_argument("--warmup", type=int, default=2, help="untimed warm-up batches")
    p.add_argument(
        "--compare",
        action="store_true",
        help="time the torch members and the fast path (ONNX Runtime, python -m predictor.fast_build) in "
        "turns on the same prompts, and score both on the test and validation splits (ms_ratio_to_shipped, "
        "tau_shipped, tau_fast, val_tau_shipped, val_tau_fast)",
    )


def _random_model(args) -> store.LoadedModel:
    """A model of the ``--quick`` size with random weights (what the timing needs is its shape)."""
    log.info("no --predictor: timing a random model of the --quick size")
    prompts = [r.prompt for r in records_for(args.dataset, args.data_dir)]
    tok = train_wordpiece(prompts[:5000], QUICK.vocab_size)
    buckets = quantile_buckets(np.arange(1, 1000), 16)
    model = build_classifier(QUICK, tok, buckets.n).to(args.device).eval()
    return store.LoadedModel(model, tok, buckets, {"version": "random", "max_len": QUICK.max_len}, Path("."))


def run(args) -> dict:
    if args.batch_size < 1 or args.num_queries < 1:
        raise ValueError("--batch-size and --num-queries must be positive")
    if args.compare:
        return compare(args)
    fast = args.device == "cpu"  # the fast path runs on the CPU
    if args.predictor:
        loaded = store.load(args.predictor, args.device)
        predictor = LengthPredictor(loaded, Path(args.predictor), max_batch=args.batch_size, fast=fast)
    else:
        predictor = LengthPredictor(_random_model(args), None, max_batch=args.batch_size)
    prompts = [r.prompt for r in records_for(args.dataset, args.data_dir)]
    batches = fast_build.sample_batches(prompts, args.num_queries, args.batch_size)
    prompts = [p for bt in batches for p in bt]
    for bt in batches[: args.warmup]:
        predictor.predict(bt)
    times = []
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
        "backend": predictor.backend,
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


def compare(args) -> dict:
    """The torch members and the fast path of ``--predictor`` on the same batches, in turns; both scored
    on the test and validation splits (the fast recipe was chosen on validation: ``fast.json``)."""
    if not args.predictor or args.device != "cpu":
        raise ValueError("--compare needs --predictor and the CPU (the fast path runs on ONNX Runtime's CPU)")
    loaded = store.load(args.predictor, args.device)
    torch_path = LengthPredictor(loaded, Path(args.predictor), max_batch=args.batch_size, fast=False)
    fast_path = LengthPredictor(loaded, Path(args.predictor), max_batch=args.batch_size)
    fast = fast_path.fast_model
    if fast is None:
        raise ValueError(f"{loaded.path} has no fast path: build it with python -m predictor.fast_build")
    prompts = [r.prompt for r in records_for(args.dataset, args.data_dir)]
    batches = fast_build.sample_batches(prompts, args.num_queries, args.batch_size)
    n = sum(len(b) for b in batches)
    times = fast_build.interleaved_ms(
        {"shipped": torch_path.predict, "fast": fast_path.predict}, batches, args.warmup
    )
    ms = {k: sum(v) / n for k, v in times.items()}
    sp = fast_build.labeled_splits(args.dataset, args.data_dir)
    taus = {}
    with torch.inference_mode():
        for name, split_name in (("", "test"), ("val_", "val")):
            data = sp[split_name]
            for key, runner in (("shipped", loaded), ("fast", fast)):
                probs = runner.predict_proba(data.prompts, args.batch_size)
                taus[f"{name}tau_{key}"] = round(fast_build.tau_of(loaded, probs, data, sp["train"]), 4)
    out = {
        "model": loaded.version,
        "backend_shipped": torch_path.backend,
        "backend_fast": fast_path.backend,
        "recipe": fast.name,
        "rule": fast.recipe.get("rule"),
        "threads": torch.get_num_threads(),
        "batch_size": args.batch_size,
        "queries": n,
        "ms_per_query_shipped": round(ms["shipped"], 3),
        "ms_per_query_fast": round(ms["fast"], 3),
        "ms_ratio_to_shipped": round(ms["fast"] / ms["shipped"], 4),
        "batch_ms_p50_shipped": round(float(np.median(times["shipped"])), 2),
        "batch_ms_p50_fast": round(float(np.median(times["fast"])), 2),
        **taus,
        "tau_drop": round(taus["tau_shipped"] - taus["tau_fast"], 4),
        "val_tau_drop": round(taus["val_tau_shipped"] - taus["val_tau_fast"], 4),
        "n_test": len(sp["test"]),
        "n_val": len(sp["val"]),
    }
    print(
        f"{out['ms_per_query_fast']} ms per query on the fast path ({fast.name}) against "
        f"{out['ms_per_query_shipped']} ms with torch: ratio {out['ms_ratio_to_shipped']}; test tau "
        f"{out['tau_fast']} against {out['tau_shipped']}, validation {out['val_tau_fast']} against {out['val_tau_shipped']}"
    )
    return out
