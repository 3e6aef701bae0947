"""``fleetbatch engine bench``: static padded batches vs Hugging Face continuous batching vs this engine.

Same model, same queries (real prompts, forced response lengths from a real dataset), side
by side in one run. Forced length = the record's response length in tokens of the model's
tokenizer, capped at ``--max-len``; prompts are cut to their last ``--max-prompt`` tokens.

* ``static``: ``model.generate`` on left-padded batches of ``--batch-size`` queries in arrival
  order (MICO's baseline); a batch runs until its longest member is done.
* ``hf_continuous``: the continuous-batching manager behind ``model.generate_batch``
  (``continuous_batching_context_manager``), used directly so that each query gets its own
  forced length (``generate_batch`` takes one ``max_new_tokens`` for all).
* ``engine``: :class:`engines.engine.LLMEngine`.

Cumulative KV tokens = sum over iterations of the tokens held in the cache after the
iteration: static counts the padded batch (``batch * (padded prompt + t)``), continuous
methods count each live query's own length.
"""

from __future__ import annotations

import json
import logging
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from engines.config import EngineConfig
from engines.engine import LLMEngine
from engines.interface import Request, SamplingParams
from fleetdata.datasets import load_dataset, response_lengths
from localmodels import load_or_build

log = logging.getLogger(__name__)


def with_defaults(args, **defaults):
    """``args`` with each of ``defaults`` set where the command line left it ``None``: ``--num-queries``
    and ``--max-len`` default per kind of bench, each to the workload of its headline figure
    (docs/BENCHMARKS.md)."""
    for name, value in defaults.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    return args


@dataclass
class Query:
    qid: str
    prompt_ids: list[int]
    length: int  # forced response length


@dataclass
class MethodResult:
    name: str
    elapsed_s: float = 0.0
    cpu_s: float = 0.0  # process CPU time (all threads): steadier than wall time on a shared machine
    tokens: int = 0
    completion_s: list[float] = field(default_factory=list)  # per query, from the method's start
    cumulative_kv_tokens: int = 0
    notes: str = ""

    def summary(self) -> dict:
        c = sorted(self.completion_s)
        pick = (lambda q: round(c[min(len(c) - 1, int(q * len(c)))], 3)) if c else (lambda q: None)
        return {
            "tokens_per_s": round(self.tokens / self.elapsed_s, 2) if self.elapsed_s else 0.0,
            "elapsed_s": round(self.elapsed_s, 3),
            "tokens_per_cpu_s": round(self.tokens / self.cpu_s, 2) if self.cpu_s else 0.0,
            "cpu_s": round(self.cpu_s, 3),
            "tokens": self.tokens,
            "mean_completion_s": round(sum(c) / len(c), 3) if c else None,
            "p50_completion_s": pick(0.5),
            "p90_completion_s": pick(0.9),
            "cumulative_kv_tokens": self.cumulative_kv_tokens,
            **({"notes": self.notes} if self.notes else {}),
        }


def load_queries(
    tokenizer, dataset: str, n: int, max_len: int, max_prompt: int, seed: int, data_dir: str | None
) -> list[Query]:

    records = load_dataset(dataset, Path(data_dir) if data_dir else None)
    if not records:
        raise ValueError(f"dataset {dataset!r} has no records")
    rng = random.Random(seed)
    records = rng.sample(records, min(n, len(records)))
    lengths = response_lengths(records, tokenizer)
    out = []
    for i, (r, length) in enumerate(zip(records, lengths, strict=True)):
        ids = tokenizer(r.prompt)["input_ids"][-max_prompt:]
        out.append(Query(f"q{i}", ids, max(1, min(length, max_len))))
    return out


def _kv_continuous(queries: list[Query]) -> int:
    """Sum over iterations of each live query's cached tokens: P, P+1, ..., P+G-1 per query."""
    return sum(q.length * len(q.prompt_ids) + q.length * (q.length - 1) // 2 for q in queries)


@torch.inference_mode()
def run_static(
    model, tokenizer, queries: list[Query], batch_size: int, progress: bool = True
) -> MethodResult:
    res = MethodResult("static")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    cpu0, start = time.process_time(), time.perf_counter()
    for b in tqdm(range(0, len(queries), batch_size), desc="static", disable=not progress, unit="batch"):
        batch = queries[b : b + batch_size]
        width = max(len(q.prompt_ids) for q in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, q in enumerate(batch):
            ids[r, width - len(q.prompt_ids) :] = torch.tensor(q.prompt_ids)
            mask[r, width - len(q.prompt_ids) :] = 1
        g = max(q.length for q in batch)
        model.generate(
            ids, attention_mask=mask, max_new_tokens=g, min_new_tokens=g, do_sample=False, pad_token_id=pad
        )
        done = time.perf_counter() - start
        res.completion_s.extend([done] * len(batch))
        res.tokens += sum(q.length for q in batch)  # useful tokens only; padding rows' extra tokens are waste
        res.cumulative_kv_tokens += len(batch) * (g * width + g * (g - 1) // 2)
    res.elapsed_s = time.perf_counter() - start
    res.cpu_s = time.process_time() - cpu0
    return res


@torch.inference_mode()
def run_hf_continuous(
    model,
    tokenizer,
    queries: list[Query],
    max_running: int,
    kv_tokens: int,
    block_size: int,
    step_tokens: int,
) -> MethodResult:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    res = MethodResult("hf_continuous")
    gen = GenerationConfig(
        do_sample=False, max_new_tokens=max(q.length for q in queries), eos_token_id=-1, pad_token_id=0
    )
    cb = ContinuousBatchingConfig(
        max_requests_per_batch=max_running,
        num_blocks=max(1, kv_tokens // block_size),
        page_size=block_size,
        max_batch_tokens=step_tokens,
    )
    cpu0, start = time.process_time(), time.perf_counter()
    with model.continuous_batching_context_manager(
        generation_config=gen, continuous_batching_config=cb, warmup=False
    ) as manager:
        for q in queries:
            manager.add_request(q.prompt_ids, request_id=q.qid, max_new_tokens=q.length, eos_token_id=-1)
        got: dict[str, float] = {}
        with tqdm(total=len(queries), desc="hf_continuous", unit="query") as bar:
            while len(got) < len(queries):
                r = manager.get_result(timeout=1)
                if r is not None and r.is_finished() and r.request_id not in got:
                    if r.error:
                        raise RuntimeError(f"HF continuous batching failed on {r.request_id}: {r.error}")
                    got[r.request_id] = time.perf_counter() - start
                    res.tokens += len(r.generated_tokens)
                    bar.update(1)
                elif r is None and not manager.is_running():
                    raise RuntimeError("HF continuous batching stopped before finishing every query")
    res.cpu_s = time.process_time() - cpu0
    res.elapsed_s = max(got.values())
    res.completion_s = list(got.values())
    res.cumulative_kv_tokens = _kv_continuous(queries)
    res.notes = "cumulative KV computed from query lengths (the manager does not expose it)"
    return res


def run_engine(
    model, tokenizer, queries: list[Query], config: EngineConfig
) -> tuple[MethodResult, LLMEngine]:
    res = MethodResult("engine")
    engine = LLMEngine.build(model, tokenizer, config)
    cpu0, start = time.process_time(), time.perf_counter()
    for q in queries:
        sp = SamplingParams(max_tokens=q.length, forced_length=q.length)
        # Admission uses the forced length as the prediction (a perfect predictor here); predictor
        # error (queries outgrowing predictions) is exercised by the preemption tests.
        engine.add_request(Request(q.qid, "", sp, prompt_token_ids=q.prompt_ids, predicted_tokens=q.length))
    with tqdm(total=len(queries), desc="engine", unit="query") as bar:
        while engine.has_unfinished():
            for out in engine.step():
                if out.finish_reason not in ("length", "stop"):
                    raise RuntimeError(f"engine failed on {out.request_id}: {out.finish_reason} {out.error}")
                res.completion_s.append(time.perf_counter() - start)
                res.tokens += out.completion_tokens
                bar.update(1)
    res.elapsed_s = time.perf_counter() - start
    res.cpu_s = time.process_time() - cpu0
    res.cumulative_kv_tokens = engine.cumulative_kv_tokens
    res.notes = f"{engine.num_steps} steps, {engine.num_preemptions} preemptions"
    return res, engine


def plot(results: dict[str, MethodResult], out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    names = list(results)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    axes[0].bar(names, [results[n].summary()["tokens_per_s"] for n in names], color="C0")
    axes[0].set_ylabel("generated tokens / s")
    axes[0].set_title("throughput")
    axes[1].bar(names, [results[n].cumulative_kv_tokens / 1e6 for n in names], color="C1")
    axes[1].set_ylabel("cumulative KV tokens (millions)")
    axes[1].set_title("KV-cache use")
    fig.tight_layout()
    p1 = out_dir / "engine_bench_throughput_kv.png"
    fig.savefig(p1, dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for n in names:
        c = sorted(results[n].completion_s)
        ax.step(c, [(i + 1) / len(c) for i in range(len(c))], where="post", label=n)
    ax.set_xlabel("query completion time (s)")
    ax.set_ylabel("fraction of queries done")
    ax.legend()
    fig.tight_layout()
    p2 = out_dir / "engine_bench_completion_cdf.png"
    fig.savefig(p2, dpi=120)
    plt.close(fig)
    return [str(p1), str(p2)]


def bench(args) -> dict:
    """Run the three methods on the same queries; returns the summary printed as the last line."""
    with_defaults(args, num_queries=48, max_len=256)
    if args.num_queries < 1 or args.batch_size < 1 or args.max_len < 1 or args.max_prompt < 1:
        raise ValueError("--num-queries, --batch-size, --max-len and --max-prompt must be >= 1")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = set(methods) - {"static", "hf_continuous", "engine"}
    if unknown:
        raise ValueError(f"unknown method(s) {sorted(unknown)}; choose from static, hf_continuous, engine")
    torch.manual_seed(args.seed)
    model, tok = load_or_build(args.served_model, arch=args.arch, size=args.size)
    queries = load_queries(
        tok, args.dataset, args.num_queries, args.max_len, args.max_prompt, args.seed, args.data_dir
    )
    total = sum(q.length for q in queries)
    log.info(
        "%d queries, %d forced tokens (mean %.1f, max %d), prompts mean %.1f tokens",
        len(queries),
        total,
        total / len(queries),
        max(q.length for q in queries),
        sum(len(q.prompt_ids) for q in queries) / len(queries),
    )
    # Same KV memory as one static batch; within it the continuous methods may run more queries at
    # once (MICO's adaptive batch size: admission by predicted length, not by a fixed count).
    running = args.engine_max_running or 4 * args.batch_size
    kv_tokens = args.kv_budget_tokens or args.batch_size * (args.max_prompt + args.max_len)
    config = EngineConfig(
        kv_budget_tokens=kv_tokens,
        block_size=args.block_size,
        max_batch_tokens=args.max_batch_tokens,
        prefill_chunk=args.prefill_chunk,
        max_running=running,
        safety_margin=args.safety_margin,
    )
    warm = queries[: min(2, len(queries))]
    warm = [Query(q.qid, q.prompt_ids, min(q.length, 4)) for q in warm]
    results: dict[str, MethodResult] = {}
    for m in methods:  # warm-up on two short queries, then the timed run
        if m == "static":
            run_static(model, tok, warm, args.batch_size, progress=False)
            results[m] = run_static(model, tok, queries, args.batch_size)
        elif m == "engine":
            run_engine(model, tok, warm, config)
            results[m] = run_engine(model, tok, queries, config)[0]
        else:
            results[m] = run_hf_continuous(
                model, tok, queries, running, kv_tokens, args.block_size, args.max_batch_tokens
            )
        log.info("%s: %s", m, results[m].summary())
    summary = {
        "model": args.served_model or f"{args.arch}-{args.size} (random weights)",
        "dataset": args.dataset,
        "queries": len(queries),
        "forced_tokens": total,
        "max_len_cap": args.max_len,
        "batch_size": args.batch_size,
        "engine_max_running": running,
        "kv_budget_tokens": kv_tokens,
        "torch_threads": torch.get_num_threads(),
        "methods": {m: r.summary() for m, r in results.items()},
    }
    eng = results.get("engine")
    if eng:
        # Headline ratios use --timing (cpu: process CPU seconds; wall: elapsed); both are in "methods".
        clock = (lambda r: r.cpu_s) if args.timing == "cpu" else (lambda r: r.elapsed_s)
        summary["timing"] = args.timing
        summary["tokens_per_s"] = round(eng.tokens / clock(eng), 2) if clock(eng) else 0.0
        for other, key in (("static", "speedup_vs_static"), ("hf_continuous", "speedup_vs_hf_continuous")):
            if other in results and clock(results[other]) and clock(eng):
                summary[key] = round(clock(results[other]) / clock(eng), 3)
                summary[key + "_wall"] = round(results[other].elapsed_s / eng.elapsed_s, 3)
        if "static" in results and results["static"].cumulative_kv_tokens:
            summary["kv_ratio_vs_static"] = round(
                eng.cumulative_kv_tokens / results["static"].cumulative_kv_tokens, 3
            )
    if args.out:
        out = Path(args.out)
        summary["figures"] = plot(results, out)
        (out / "engine_bench.json").write_text(json.dumps(summary, indent=2))
    return summary
