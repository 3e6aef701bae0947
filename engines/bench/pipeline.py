"""``fleetbatch engine bench --stages N`` / ``--plan plan.json``: a plan run as pipeline stages, measured.

Side by side in one run, on the same model and workload (real prompts from the dataset cut or
cycled to exactly ``--prompt-len`` tokens, every response forced to ``--gen-len`` tokens, all
queries submitted at once):

* ``one_process``: the same model in one process with as many threads as one stage;
* ``planned``: the plan's stages, one process each (gloo on CPU);
* ``even``: with unlike stages, the same stages and micro-batches with the layers split evenly
  (and the LM head on the last stage);
* ``even_listed``: when the planner ordered the devices otherwise than the cluster lists them,
  the even split in the listed order too (what a user splitting by hand would run);
* ``head_on_last``: when the plan shares the LM head between the first and last stage
  (``fleetbatch planner plan --head-split``, on unless ``--no-head-split``), the same plan with the whole
  head on the last stage.

Without ``--plan`` the planner lays the model out itself: ``fleetbatch engine profile --concurrent N``'s
measurement of the engine's own layer and LM head on this CPU (N profilers at once, as the N
stages will share the memory system) goes to ``fleetbatch planner plan`` (its CLI), which solves
the ILP over N ``CPU`` devices whose ``slowdown`` comes from ``--stage-speeds``; nothing needs
preparing.

Contention on a small machine: every stage uses one thread, the one-process run uses one
thread, stage compute is timed on the thread's CPU clock, and a slower device is emulated by
sleeping (which takes no CPU). The configurations run in ``--repeats`` interleaved rounds
(one of each, back to back); a ratio is the median over rounds of that round's ratio, so a
machine whose speed drifts between minutes does not favour whichever ran first.
"""

from __future__ import annotations

import json
import logging
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

from engines.bench.compare import load_queries, with_defaults
from engines.config import EngineConfig, PipelineConfig
from engines.engine import LLMEngine
from engines.interface import Request, SamplingParams
from localmodels import load_or_build

log = logging.getLogger(__name__)


def slowdowns_from_speeds(speeds: list[float]) -> list[float]:
    """Relative speeds (``1,2``: the second stage is twice as fast) -> extra-time factors; the fastest runs at full speed."""
    if not speeds or any(s <= 0 for s in speeds):
        raise ValueError(f"stage speeds must be positive numbers, got {speeds}")
    top = max(speeds)
    return [top / s - 1.0 for s in speeds]


def _run_cli(cmd: list[str], what: str) -> None:
    log.info("running %s", " ".join(cmd[2:]))
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise ValueError(f"{what} failed: {r.stderr.strip().splitlines()[-1:] or r.returncode}")


def _planner(*argv: str) -> None:
    _run_cli([sys.executable, "-m", "planner.cli", *argv], f"planner {argv[0]}")


def make_plan(args, slowdowns: list[float], workdir: Path) -> Path:
    """Profile the engine's layer on this CPU and plan the model over ``len(slowdowns)`` emulated devices."""
    model = f"{args.arch}:{args.size}"
    spec = {
        "name": f"{len(slowdowns)}xCPU",
        "nodes": [
            {"name": "local", "devices": [{"type": "CPU", "count": 1, "slowdown": s} for s in slowdowns]}
        ],
    }
    cluster = workdir / "cluster.yaml"
    cluster.write_text(yaml.safe_dump(spec))
    profile = workdir / "profile.json"
    p, g = args.prompt_len, args.gen_len
    try:
        grid = {int(v) for v in args.profile_batches.split(",") if v.strip()}
    except ValueError:
        raise ValueError(
            f"--profile-batches: comma-separated batch sizes, not {args.profile_batches!r}"
        ) from None
    if not grid or min(grid) < 1:
        raise ValueError(f"--profile-batches: positive batch sizes, not {args.profile_batches!r}")
    batches = ",".join(str(v) for v in sorted(grid | {args.num_queries}))
    lengths = ",".join(str(c) for c in sorted({p, p + g // 2, p + g}))
    cmd = [sys.executable, "-m", "engines.cli", "profile", "--arch", args.arch, "--size", args.size]
    cmd += [
        "--batches",
        batches,
        "--lengths",
        lengths,
        "--concurrent",
        str(len(slowdowns)),
        "--reps",
        str(args.profile_reps),
        "--min-time",
        str(args.profile_min_time),
        "--out",
        str(profile),
    ]
    if args.served_model:
        cmd += ["--served-model", args.served_model]
    _run_cli(cmd, "fleetbatch engine profile")
    plan = workdir / "plan.json"
    _planner(
        "plan",
        "--cluster-spec",
        str(cluster),
        "--shape",
        model,
        "--profile",
        f"CPU={profile}",
        "--bits",
        args.bits,
        "--tp-sizes",
        "1",
        "--prefill-chunks",
        "1",
        "--stages",
        str(len(slowdowns)),
        "--batch-size",
        str(args.num_queries),
        "--prompt-len",
        str(args.prompt_len),
        "--output-tokens",
        str(args.gen_len),
        "--out",
        str(plan),
        *(["--head-split"] if args.head_split else []),
    )
    return plan


def _workload(tokenizer, args) -> list[Request]:
    queries = load_queries(tokenizer, args.dataset, args.num_queries, 1, 10**6, args.seed, args.data_dir)
    reqs = []
    for q in queries:
        ids = (q.prompt_ids * (args.prompt_len // max(1, len(q.prompt_ids)) + 1))[-args.prompt_len :]
        sp = SamplingParams(max_tokens=args.gen_len, forced_length=args.gen_len)
        reqs.append(Request(q.qid, "", sp, prompt_token_ids=ids, predicted_tokens=args.gen_len))
    return reqs


def _run(
    args, requests: list[Request], plan: Path | None, even: bool = False, head_split: bool = True
) -> dict:
    model, tok = load_or_build(args.served_model, arch=args.arch, size=args.size)
    cfg = EngineConfig(
        kv_budget_tokens=args.num_queries * (args.prompt_len + args.gen_len) + 64,
        max_batch_tokens=max(args.max_batch_tokens, args.prompt_len),
        prefill_chunk=max(args.prefill_chunk, args.prompt_len),
        max_running=args.num_queries,
        plan_path=str(plan) if plan else None,
        pipeline=PipelineConfig(even_split=even, head_split=head_split),
    )
    engine = LLMEngine.build(model, tok, cfg)
    try:
        engine.generate(
            [Request(f"w{i}", "", r.sampling, r.prompt_token_ids[:8]) for i, r in enumerate(requests[:2])]
        )
        before = engine.pipeline.stage_counters() if engine.pipeline else []
        reqs = [
            Request(r.request_id, "", r.sampling, list(r.prompt_token_ids), r.predicted_tokens)
            for r in requests
        ]
        t0 = time.perf_counter()
        outs = engine.generate(reqs)
        wall = time.perf_counter() - t0
        after = engine.pipeline.stage_counters() if engine.pipeline else []
    finally:
        engine.close()
    tokens = sum(o.completion_tokens for o in outs)
    stages = []
    for s, b, a in zip(engine.stages, before, after, strict=False):
        d = {k: a[k] - b[k] for k in a}
        busy = d["compute_s"] + d["sleep_s"]
        n_dec = d["decode_micro_batches"]
        stages.append(
            {
                "layers": [s.layer_start, s.layer_end],
                "slowdown": s.slowdown,
                "micro_batches": int(d["micro_batches"]),
                "compute_s": round(d["compute_s"], 4),
                "emulated_s": round(d["sleep_s"], 4),
                "not_computing_s": round(max(0.0, wall - busy), 4),  # wall - compute - emulated
                "waiting_s": round(d["idle_s"], 4),  # blocked on a receive (measured)
                "memory_mib": round(a["memory_bytes"] / 2**20, 2),
                "decode_latency_ms": round(1e3 * d["decode_latency_s"] / n_dec, 3) if n_dec else None,
                "decode_rows_per_micro_batch": round(d["decode_rows"] / n_dec, 2) if n_dec else None,
                # the plan predicts its own layer split only
                "predicted_decode_ms": None
                if even or not head_split
                else round(1e3 * s.predicted_decode_s, 3),
            }
        )
    busy = sum(st["compute_s"] + st["emulated_s"] for st in stages)
    return {
        "tokens": tokens,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 2),
        "stages": stages,
        "bubble_fraction": round(1 - busy / (len(stages) * wall), 4) if stages else 0.0,
    }


def listed_order_plan(plan_doc: dict, slowdowns: list[float], path: Path) -> Path | None:
    """The plan with its stages on devices in the order ``--stage-speeds`` listed them (``slowdowns``),
    written to ``path`` (its layers are split evenly when run), or None when the planner kept
    that order."""
    stages = plan_doc["stages"]
    pool = list(stages)
    listed = []
    for want in slowdowns:  # the first unused stage whose device has this slowdown
        st = next(st for st in pool if plan_doc["devices"][st["device_index"]].get("slowdown", 0.0) == want)
        pool.remove(st)
        listed.append(st)
    if listed == stages:
        return None
    bits = [b for st in stages for b in st["bits"]]
    n = len(bits)
    cuts = [round(k * n / len(listed)) for k in range(len(listed) + 1)]
    doc = {**plan_doc, "head_split": 0.0, "stages": []}
    for st, lo, hi in zip(listed, cuts, cuts[1:], strict=False):
        doc["stages"].append({**st, "layer_start": lo, "layer_end": hi, "bits": bits[lo:hi]})
    path.write_text(json.dumps(doc))
    return path


def _rounds(
    args, requests, plan: Path, uneven: bool, split: bool, listed: Path | None = None
) -> dict[str, list[dict]]:
    """``--repeats`` rounds, each running every configuration once, back to back (interleaved, so a
    machine whose speed drifts over minutes slows all of a round's runs alike)."""
    runs: dict[str, list[dict]] = {
        "one_process": [],
        "planned": [],
        "even": [],
        "even_listed": [],
        "head_on_last": [],
    }
    for r in range(args.repeats):
        runs["one_process"].append(_run(args, requests, None))
        runs["planned"].append(_run(args, requests, plan))
        if uneven:
            runs["even"].append(_run(args, requests, plan, even=True))
        if listed is not None:  # only set when the stages are unlike
            runs["even_listed"].append(_run(args, requests, listed, even=True))
        if split:
            runs["head_on_last"].append(_run(args, requests, plan, head_split=False))
        log.info(
            "round %d: %s tokens/s",
            r + 1,
            ", ".join(f"{k} {v[-1]['tokens_per_s']:.1f}" for k, v in runs.items() if v),
        )
    return runs


def _ratio(runs: dict[str, list[dict]], a: str, b: str) -> tuple[float, list[float]]:
    """Median over rounds of a round's ``a`` / ``b`` throughput, and the per-round ratios."""
    per = [x["tokens_per_s"] / y["tokens_per_s"] for x, y in zip(runs[a], runs[b], strict=True)]
    return round(statistics.median(per), 3), [round(x, 3) for x in per]


def _baseline(out: dict, runs: dict[str, list[dict]], name: str, key: str) -> None:
    """Add a baseline configuration to ``out``: its best round, and ``planned`` over it per round."""
    best = max(runs[name], key=lambda r: r["tokens_per_s"])
    out[f"{name}_tokens_per_s"] = best["tokens_per_s"]
    out[key], out[f"{key}_rounds"] = _ratio(runs, "planned", name)
    out[name] = best


def latency_error(run: dict) -> float:
    """Mean over stages of |measured - predicted| / predicted decode-micro-batch latency."""
    errs = [
        abs(st["decode_latency_ms"] - st["predicted_decode_ms"]) / st["predicted_decode_ms"]
        for st in run["stages"]
        if st["decode_latency_ms"] and st["predicted_decode_ms"]
    ]
    return round(sum(errs) / len(errs), 4) if errs else float("nan")


def bench_pipeline(args) -> dict:
    with_defaults(args, num_queries=48)
    torch.set_num_threads(1)
    if args.plan is None:  # the planner lays the model out over --stages devices at --stage-speeds
        speeds = (
            [float(x) for x in args.stage_speeds.split(",")] if args.stage_speeds else [1.0] * args.stages
        )
        if len(speeds) != args.stages:
            raise ValueError(f"--stage-speeds lists {len(speeds)} speeds for --stages {args.stages}")
    elif args.stage_speeds:
        raise ValueError("--stage-speeds goes with --stages: a given --plan declares its devices' speeds")
    with tempfile.TemporaryDirectory(prefix="fleetbatch-bench-") as tmp:
        plan = Path(args.plan) if args.plan else make_plan(args, slowdowns_from_speeds(speeds), Path(tmp))
        plan_doc = json.loads(plan.read_text())
        _, tok = load_or_build(args.served_model, arch=args.arch, size=args.size)
        requests = _workload(tok, args)
        uneven = any(d.get("slowdown", 0) for d in plan_doc["devices"])
        split = plan_doc.get("head_split", 0.0) > 0
        listed = None
        if uneven and args.plan is None:
            listed = listed_order_plan(plan_doc, slowdowns_from_speeds(speeds), Path(tmp) / "listed.json")
        runs = _rounds(args, requests, plan, uneven, split, listed)
    planned = max(runs["planned"], key=lambda r: r["tokens_per_s"])
    one = max(runs["one_process"], key=lambda r: r["tokens_per_s"])
    speedup, speedups = _ratio(runs, "planned", "one_process")
    out = {
        "stages": len(planned["stages"]),
        "layers": [st["layers"] for st in planned["stages"]],
        "stage_slowdowns": [st["slowdown"] for st in planned["stages"]],
        "decode_micro_batch": plan_doc["decode_micro_batch"],
        "head_split": plan_doc.get("head_split", 0.0),
        "prefill_micro_batch": plan_doc["prefill_micro_batch"],
        "queries": len(requests),
        "prompt_len": args.prompt_len,
        "gen_len": args.gen_len,
        "repeats": args.repeats,
        "figures": "speedups: median of per-round ratios; tokens_per_s: the best round",
        "tokens_per_s": planned["tokens_per_s"],
        "one_process_tokens_per_s": one["tokens_per_s"],
        "speedup_vs_one_process": speedup,
        "speedup_vs_one_process_rounds": speedups,
        "stage_latency_error": latency_error(planned),
        "bubble_fraction": planned["bubble_fraction"],
        "planned": planned,
        "one_process": one,
    }
    if uneven:
        _baseline(out, runs, "even", "speedup_vs_even_partition")
    if runs["even_listed"]:
        _baseline(out, runs, "even_listed", "speedup_vs_even_listed_order")
    if split:
        _baseline(out, runs, "head_on_last", "speedup_vs_head_on_last")
    return out
