"""``fleetbatch predictor bench``: time batched predictions (the serving path) on real prompts."""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from predictor import store
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
    if args.predictor:
        predictor = LengthPredictor(
            store.load(args.predictor, args.device), Path(args.predictor), max_batch=args.batch_size
        )
    else:
        predictor = LengthPredictor(_random_model(args), None, max_batch=args.batch_size)
    prompts = [r.prompt for r in records_for(args.dataset, args.data_dir)]
    rng = np.random.default_rng(0)
    prompts = [
        prompts[i] for i in rng.choice(len(prompts), size=min(args.num_queries, len(prompts)), replace=False)
    ]
    batches = [prompts[i : i + args.batch_size] for i in range(0, len(prompts), args.batch_size)]
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
