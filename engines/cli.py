"""The ``engine`` command: run one cluster's engine (``serve``), offline generation and benchmarks."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch

from cliutil import enable_config_file, run_main
from engines import serve
from engines.bench.compare import bench
from engines.bench.pipeline import bench_pipeline
from engines.bench.prefix import prefix_bench
from engines.bench.profile import run_profile
from engines.config import EngineConfig
from engines.engine import LLMEngine
from engines.interface import Request, SamplingParams
from workqueue.embedded import die_with_parent_from_env

log = logging.getLogger("engine")


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and engine")
    g.add_argument(
        "--served-model", default=None, help="local Hugging Face model directory (default: a random model)"
    )
    g.add_argument(
        "--arch", default="llama", choices=["llama", "gpt2", "opt"], help="random model architecture"
    )
    g.add_argument(
        "--size", default="tiny", choices=["nano", "micro", "tiny", "small", "base"], help="random model size"
    )
    g.add_argument("--kv-budget-tokens", type=int, default=None, help="KV cache size in tokens")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--max-batch-tokens", type=int, default=512, help="tokens computed per step")
    g.add_argument(
        "--prefill-chunk", type=int, default=256, help="longest prefill chunk of one query per step"
    )
    g.add_argument("--safety-margin", type=float, default=0.1, help="admission reserves predicted*(1+margin)")
    g.add_argument(
        "--plan", default=None, help="plan.json from the planner (micro-batch sizes -> step limits)"
    )
    serve.add_prefix_cache_argument(g)
    g.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: torch's choice; bench default 1, steadier on a shared CPU)",
    )


def _config(args: argparse.Namespace, max_running: int) -> EngineConfig:
    cfg = EngineConfig(
        block_size=args.block_size,
        max_batch_tokens=args.max_batch_tokens,
        prefill_chunk=args.prefill_chunk,
        max_running=max_running,
        safety_margin=args.safety_margin,
        plan_path=args.plan,
        prefix_cache=args.prefix_cache,
    )
    if args.kv_budget_tokens is not None:
        cfg.kv_budget_tokens = args.kv_budget_tokens
    cfg.validate()
    return cfg


def _read_requests(path: str, args: argparse.Namespace) -> list[Request]:
    src = sys.stdin if path == "-" else None
    if src is None and not Path(path).is_file():
        raise FileNotFoundError(f"input file {path} not found")
    lines = (src or open(path, encoding="utf-8")).read().splitlines()
    reqs = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: line {n} is not valid JSON ({e.msg})") from e
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise ValueError(f"{path}: line {n} needs a string 'prompt' field")
        rid = str(row.get("id", row.get("request_id", f"line{n}")))
        sp = SamplingParams(
            temperature=float(row.get("temperature", args.temperature)),
            top_p=float(row.get("top_p", args.top_p)),
            seed=row.get("seed", args.seed),
            max_tokens=int(row.get("max_tokens", args.max_tokens)),
            forced_length=row.get("forced_length"),
        )
        try:
            sp.validate()
        except ValueError as e:
            raise ValueError(f"{path}: line {n}: {e}") from e
        reqs.append(Request(rid, row["prompt"], sp, predicted_tokens=row.get("predicted_tokens")))
    if not reqs:
        raise ValueError(f"{path}: no requests")
    if len({r.request_id for r in reqs}) != len(reqs):
        raise ValueError(f"{path}: request ids are not unique")
    return reqs


def run_generate(args: argparse.Namespace) -> int:
    reqs = _read_requests(args.input, args)
    engine = LLMEngine.from_pretrained(
        args.served_model, args.arch, args.size, _config(args, args.max_running)
    )
    start = time.perf_counter()
    try:
        outs = engine.generate(reqs, progress=True)
    finally:
        engine.close()
    elapsed = time.perf_counter() - start
    rows = []
    for o in outs:
        row = {
            "id": o.request_id,
            "text": o.text,
            "prompt_tokens": o.prompt_tokens,
            "completion_tokens": o.completion_tokens,
            "finish_reason": o.finish_reason,
        }
        if args.token_ids:
            row["token_ids"] = o.token_ids
        if o.error:
            row["error"] = o.error
        rows.append(json.dumps(row) + "\n")
    if args.out == "-":
        sys.stdout.writelines(rows)
        sys.stdout.flush()
    else:
        Path(args.out).write_text("".join(rows), encoding="utf-8")
    tokens = sum(o.completion_tokens for o in outs)
    summary = {
        "requests": len(outs),
        "generated_tokens": tokens,
        "elapsed_s": round(elapsed, 3),
        "tokens_per_s": round(tokens / elapsed, 2) if elapsed else 0.0,
        "errors": sum(o.finish_reason == "error" for o in outs),
        "preemptions": engine.num_preemptions,
        "output": args.out,
    }
    log.info("generated %d tokens for %d requests in %.1f s", tokens, len(outs), elapsed)
    print(json.dumps(summary), file=sys.stderr if args.out == "-" else sys.stdout)
    return 0


def run_bench(args: argparse.Namespace) -> int:
    if args.prefix_workload:
        result = prefix_bench(args)
    elif args.stages or args.plan:
        if args.repeats < 1 or args.prompt_len < 1 or args.gen_len < 1:
            raise ValueError("--repeats, --prompt-len and --gen-len must be >= 1")
        result = bench_pipeline(args)
    else:
        result = bench(args)
    print(json.dumps(result))
    return 0


def build_parser(prog: str = "fleetbatch engine") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description=(
            "Per-cluster inference engine. `serve` pulls queries from the cluster's Redis queue and "
            "generates them with iteration-level batching; `generate` runs a JSONL file offline; "
            "`bench` compares the engine with static and Hugging Face continuous batching."
        ),
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)
    serve_parser = sub.add_parser(
        "serve",
        help="serve one cluster: consume its Redis queue, generate, write results",
        description="Serve one cluster: take queries from its Redis queue, generate, write results once per query.",
    )
    serve.add_serve_arguments(serve_parser)
    enable_config_file(serve_parser)  # every option also from FLEETBATCH_<OPTION> or a YAML file

    gen = sub.add_parser(
        "generate",
        help="generate a JSONL file of prompts offline with the native engine",
        description=(
            'Read JSONL requests ({"id", "prompt", optional "max_tokens", "temperature", "top_p", '
            '"seed", "forced_length", "predicted_tokens"}), generate them with iteration-level batching, '
            'write JSONL results ({"id", "text", "prompt_tokens", "completion_tokens", "finish_reason"}) '
            "in input order. A JSON summary is the last line of stdout (stderr when the output is stdout)."
        ),
    )
    gen.add_argument("input", help="JSONL file of requests ('-' for stdin)")
    gen.add_argument("-o", "--out", default="-", help="JSONL results file ('-' for stdout)")
    gen.add_argument("--max-tokens", type=int, default=128, help="default max_tokens per request")
    gen.add_argument("--temperature", type=float, default=0.0, help="default temperature (0 = greedy)")
    gen.add_argument("--top-p", type=float, default=1.0, help="default top-p")
    gen.add_argument("--seed", type=int, default=None, help="default per-request seed")
    gen.add_argument("--max-running", type=int, default=64, help="queries in the running batch at once")
    gen.add_argument("--token-ids", action="store_true", help="also write the generated token ids")
    add_engine_arguments(gen)

    b = sub.add_parser(
        "bench",
        help="static batches vs HF continuous batching vs this engine, on real lengths",
        description=(
            "Side by side on the same model and queries (real prompts; forced response lengths = the "
            "dataset's recorded responses in model tokens, capped at --max-len): (a) transformers generate "
            "on static padded batches, (b) transformers continuous batching (generate_batch's manager), "
            "(c) this engine. Prints one JSON object as the last line: tokens_per_s, speedup_vs_static, "
            "speedup_vs_hf_continuous, kv_ratio_vs_static and per-method figures."
        ),
    )
    b.add_argument(
        "--dataset",
        default="mixed",
        help="mixed, gsm8k, code_alpaca, roleplay, toolformer, alpaca_eval[:model]",
    )
    b.add_argument(
        "--data-dir", default=None, help="dataset directory (default $FLEETBATCH_DATA or ../shared/data)"
    )
    b.add_argument(
        "-n",
        "--num-queries",
        type=int,
        default=None,
        help="queries sampled from the dataset (default 48; 96 with --prefix-workload)",
    )
    b.add_argument(
        "--batch-size",
        type=int,
        default=16,
        help="static batch size; the KV budget of the continuous methods is what this batch may need",
    )
    b.add_argument(
        "--engine-max-running",
        type=int,
        default=None,
        help="engine/HF continuous max running (default 4x --batch-size; the KV budget limits it too)",
    )
    b.add_argument(
        "--max-len",
        type=int,
        default=None,
        help="cap on forced response length (CPU time; default 256; 128 with --prefix-workload)",
    )
    b.add_argument("--max-prompt", type=int, default=128, help="prompts keep their last N tokens")
    b.add_argument("--methods", default="static,engine,hf_continuous", help="comma-separated subset to run")
    b.add_argument("--seed", type=int, default=0, help="query sampling seed")
    b.add_argument(
        "--timing",
        default="cpu",
        choices=["cpu", "wall"],
        help="clock of the headline figures: process CPU seconds (steady on a shared machine) or wall time",
    )
    b.add_argument("--out", default=None, help="write engine_bench.json and PNG figures here")
    pb = b.add_argument_group(
        "pipeline stages (--stages or --plan)",
        "Run a plan as one process per stage and compare it with one process (and, on unlike stages, "
        "with an even layer split). Last line: stages, tokens_per_s, speedup_vs_one_process, "
        "stage_latency_error, bubble_fraction[, speedup_vs_even_partition].",
    )
    pb.add_argument(
        "--stages",
        type=int,
        default=None,
        help="have the planner lay the model out over N emulated CPU devices (profiled here) and run it",
    )
    pb.add_argument(
        "--stage-speeds",
        default=None,
        help="relative speeds of the N devices, e.g. 1,2: the second is twice as fast (the slower one "
        "sleeps the extra time)",
    )
    pb.add_argument(
        "--prompt-len", type=int, default=64, help="every prompt cut or cycled to this many tokens"
    )
    pb.add_argument("--gen-len", type=int, default=96, help="every response forced to this many tokens")
    pb.add_argument("--bits", default="16", help="weight bit widths the planner may use (default 16)")
    pb.add_argument(
        "--no-head-split",
        dest="head_split",
        action="store_false",
        help="with --stages: keep the LM head on the last stage (default: the planner may give the first "
        "stage a share of its rows, and the bench also runs the plan with the head on the last stage)",
    )
    pb.add_argument("--repeats", type=int, default=2, help="runs of each configuration; the best counts")
    pb.add_argument(
        "--profile-reps",
        type=int,
        default=3,
        help="with --stages: `fleetbatch engine profile --reps` (rounds per point)",
    )
    pb.add_argument(
        "--profile-batches",
        default="1,8,16,32,64",
        help="with --stages: the batch sizes the profile measures for the plan (--num-queries is added)",
    )
    pb.add_argument(
        "--profile-min-time",
        type=float,
        default=0.05,
        help="with --stages: `fleetbatch engine profile --min-time` (s)",
    )
    xb = b.add_argument_group(
        "the prefix cache (--prefix-workload)",
        "Run a shared-prefix batch from the real data (few-shot blocks of 200-800 tokens before real "
        "questions) and its unique-prompt twin, each with the prefix cache off and on (--repeats times, "
        "the best counts). Last line: prefix_speedup (generated tokens/s, cache on over off, shared "
        "prefixes), unique_slowdown (the cache's cost on unique prompts), hit_rate, per-run figures.",
    )
    xb.add_argument("--prefix-workload", action="store_true", help="run the prefix-cache bench")
    xb.add_argument("--prefix-groups", type=int, default=8, help="few-shot blocks, each shared by many rows")
    xb.add_argument(
        "--unique-share", type=float, default=0.2, help="share of rows with no shared prefix (0 to <1)"
    )
    add_engine_arguments(b)
    b.set_defaults(size="small", threads=1)

    pr = sub.add_parser(
        "profile",
        help="time the engine's own layer and LM head here; write a profile for `fleetbatch planner plan --profile`",
        description=(
            "Time one decoder layer of the native engine (paged KV cache, the engine's attention) and the "
            "LM head on this machine, one thread, over decode batch x context and prefill batch x prompt "
            "grids; write a fleetbatch planner profile (use it as `fleetbatch planner plan --profile CPU=profile.json`, so plans "
            "predict the engine's stages). Prints a JSON summary as the last line."
        ),
    )
    pr.add_argument("--batches", default="1,8,16,32,64", help="decode batch sizes (also the LM head's rows)")
    pr.add_argument("--lengths", default="64,128,256", help="prompt lengths and decode contexts")
    pr.add_argument("--prefill-batches", default="1,2,4", help="prefill batch sizes")
    pr.add_argument("--bits", default="16", help="weight bit widths to time (e.g. 16,8,4)")
    pr.add_argument("--reps", type=int, default=3, help="rounds over the grid; each point keeps its minimum")
    pr.add_argument("--min-time", type=float, default=0.05, help="seconds of calls per point and round")
    pr.add_argument(
        "--concurrent",
        type=int,
        default=1,
        help="run N profilers at once and keep each point's mean: the speed of a device while N-1 other "
        "stages share this machine's caches and memory bandwidth (use the number of co-located stages)",
    )
    pr.add_argument("--out", default="profile.json", help="where to write the profile")
    add_engine_arguments(pr)
    pr.set_defaults(size="small", threads=1)
    return p


def run(args: argparse.Namespace) -> int:
    if args.command == "serve":
        return serve.run_serve(args)
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    if args.command == "generate":
        return run_generate(args)
    if args.command == "profile":
        return run_profile(args)
    return run_bench(args)


def main(argv: list[str] | None = None, prog: str = "fleetbatch engine") -> int:
    die_with_parent_from_env()  # started by `fleetbatch gateway up`: not to outlive it
    return run_main(build_parser(prog), argv, run, prog=prog)


if __name__ == "__main__":
    sys.exit(main())
