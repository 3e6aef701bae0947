"""``fleetbatch engine bench --prefix-workload``: the prefix cache on and off, side by side, in one process.

Two workloads from the real data (:mod:`fleetdata.prefixes`): the *shared-prefix* batch (few-shot
blocks of 200-800 tokens, each in front of many real questions, plus a share of plain
questions) and its *unique-prompt* twin (the same questions with no prefix). Each runs on
the same engine configuration with the cache off and on, ``--repeats`` times in turn (off,
on, off, on, ...), and the fastest run of each counts. Forced response lengths are the
questions' recorded responses in model tokens, capped at ``--max-len``; prompts are not cut.

Headline: ``prefix_speedup``, generated tokens per second with the cache on over off on the
shared-prefix batch (``--timing cpu``: per second of this process's CPU time, steady on a
shared machine), and ``unique_slowdown``, the cache's cost on the unique prompts (1 - on/off).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import torch

from engines.bench.compare import MethodResult, Query, run_engine, with_defaults
from engines.config import EngineConfig
from fleetdata.datasets import Record, response_lengths
from fleetdata.prefixes import shared_prefix_rows, unique_rows
from localmodels import load_or_build

log = logging.getLogger(__name__)


def prefix_queries(tokenizer, rows: list[Record], max_len: int) -> list[Query]:
    lengths = response_lengths(rows, tokenizer)
    ids = tokenizer([r.prompt for r in rows])["input_ids"]
    return [
        Query(f"q{i}", p, max(1, min(n, max_len))) for i, (p, n) in enumerate(zip(ids, lengths, strict=True))
    ]


def _best(model, tok, queries: list[Query], config: EngineConfig, repeats: int, clock) -> tuple[dict, dict]:
    """The fastest of ``repeats`` runs with the cache off and on (taken in turn); their summaries
    with the cache's figures added."""
    best: dict[bool, tuple[MethodResult, dict]] = {}
    for _ in range(repeats):
        for on in (False, True):
            res, engine = run_engine(model, tok, queries, replace(config, prefix_cache=on))
            s = engine.stats()
            extra = {
                "prefix_hit_rate": round(s.prefix_hit_rate, 4),
                "prefill_tokens_saved": s.prefix_hit_tokens,
                "steps": engine.num_steps,
                "preemptions": engine.num_preemptions,
            }
            if on not in best or clock(res) < clock(best[on][0]):
                best[on] = (res, extra)
    off, on = ({**r.summary(), **extra} for r, extra in (best[False], best[True]))
    return off, on


def prefix_bench(args) -> dict:
    """Run both workloads with the cache off and on; returns the summary printed as the last line."""
    with_defaults(args, num_queries=96, max_len=128)  # the headline's workload (docs/BENCHMARKS.md)
    if args.num_queries < 1 or args.max_len < 1 or args.repeats < 1 or args.prefix_groups < 1:
        raise ValueError("--num-queries, --max-len, --repeats and --prefix-groups must be >= 1")
    if not 0.0 <= args.unique_share < 1.0:
        raise ValueError(f"--unique-share must be in [0, 1), got {args.unique_share}")
    torch.manual_seed(args.seed)
    model, tok = load_or_build(args.served_model, arch=args.arch, size=args.size)
    root = Path(args.data_dir) if args.data_dir else None
    rows = shared_prefix_rows(
        args.num_queries, args.prefix_groups, args.unique_share, seed=args.seed, root=root
    )
    workloads = {
        "shared_prefix": prefix_queries(tok, rows, args.max_len),
        "unique": prefix_queries(tok, unique_rows(rows), args.max_len),
    }
    config = EngineConfig(
        kv_budget_tokens=args.kv_budget_tokens or 16384,
        block_size=args.block_size,
        max_batch_tokens=args.max_batch_tokens,
        prefill_chunk=args.prefill_chunk,
        max_running=args.engine_max_running or 64,
        safety_margin=args.safety_margin,
    )
    warm = [Query(q.qid, q.prompt_ids, 2) for q in workloads["unique"][:2]]
    run_engine(model, tok, warm, config)
    key = "cpu_s" if args.timing == "cpu" else "elapsed_s"  # the clock of the figures

    def clock(r: MethodResult) -> float:
        return getattr(r, key)

    runs, tps = {}, {}
    for name, queries in workloads.items():
        log.info(
            "%s: %d queries, prompts mean %.0f tokens, %d forced tokens",
            name,
            len(queries),
            sum(len(q.prompt_ids) for q in queries) / len(queries),
            sum(q.length for q in queries),
        )
        off, on = _best(model, tok, queries, config, args.repeats, clock)
        runs[name] = {"cache_off": off, "cache_on": on}
        tps[name] = {k: v["tokens"] / v[key] for k, v in runs[name].items()}
        log.info("%s: off %s / on %s", name, off, on)
    unique_ratio = tps["unique"]["cache_on"] / tps["unique"]["cache_off"]
    return {
        "model": args.served_model or f"{args.arch}-{args.size} (random weights)",
        "queries": args.num_queries,
        "prefix_groups": args.prefix_groups,
        "unique_share": args.unique_share,
        "max_len_cap": args.max_len,
        "kv_budget_tokens": config.kv_budget_tokens,
        "engine_max_running": config.max_running,
        "torch_threads": torch.get_num_threads(),
        "timing": args.timing,
        "repeats": args.repeats,
        "runs": runs,
        "shared_prefix_tokens_per_s": {k: round(v, 2) for k, v in tps["shared_prefix"].items()},
        "unique_tokens_per_s": {k: round(v, 2) for k, v in tps["unique"].items()},
        "hit_rate": runs["shared_prefix"]["cache_on"]["prefix_hit_rate"],
        "prefix_speedup": round(tps["shared_prefix"]["cache_on"] / tps["shared_prefix"]["cache_off"], 3),
        "unique_slowdown": round(1.0 - unique_ratio, 4),
    }
