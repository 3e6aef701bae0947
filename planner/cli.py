"""``planner`` command line: ``plan``, ``compare``, ``profile``, ``fidelity`` (the last two in
:mod:`planner.cli_measure`, option parsing in :mod:`planner.cli_args`).

Benchmarks (``compare``, ``fidelity``) print one JSON object as their last line.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

from cliutil import PLAIN_LOG, run_main
from planfile import save_plan
from planner.baselines import het, uniform
from planner.build import make_plan
from planner.cli_args import CliError, _bits, _chunks, _positive, _tp_sizes, bad_input, out_folder, writing
from planner.cli_fleet import add_fleet_parser
from planner.cli_measure import add_measure_parsers
from planner.cluster import PAPER_CLUSTERS, ClusterSpecError, load_cluster
from planner.compare import markdown_table, plot_speedups, run_compare
from planner.costs import DEFAULT_BITS, Workload
from planner.latency import Profile
from planner.modelshape import load_shape
from planner.problem import build_problem
from planner.search import plan

log = logging.getLogger("planner")

PLAN_METHODS = ("ilp", "transfer", "adabits", "uniform", "het")


def expected_tokens_from_file(path: str) -> float:
    """Mean response length from a predictor length distribution file.

    Accepts a JSON list of lengths, ``{"lengths": [...]}``, or ``{"buckets": [[lo, hi, prob], ...]}``
    (bucket midpoints weighted by probability).
    """
    p = Path(path)
    if not p.exists():
        raise CliError(f"length distribution file {p} not found")
    try:
        d = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise CliError(f"length distribution {p} is not JSON: {e}") from None
    if isinstance(d, dict) and "lengths" in d:
        d = d["lengths"]
    if isinstance(d, list) and d and all(isinstance(x, (int, float)) for x in d):
        return float(statistics.fmean(d))
    if isinstance(d, dict) and "buckets" in d:
        tot = sum(float(b[2]) for b in d["buckets"])
        if tot <= 0:
            raise CliError(f"{p}: bucket probabilities sum to {tot}")
        return sum((float(b[0]) + float(b[1])) / 2 * float(b[2]) for b in d["buckets"]) / tot
    raise CliError(
        f"{p}: expected a list of lengths, {{'lengths': [...]}} or {{'buckets': [[lo, hi, p], ...]}}"
    )


def _workload(args: argparse.Namespace) -> Workload:
    if args.length_distribution:
        n = expected_tokens_from_file(args.length_distribution)
        log.info("expected output tokens %.1f from %s", n, args.length_distribution)
    elif args.output_tokens:
        n = args.output_tokens
    elif args.max_output_tokens:
        n = args.max_output_tokens / 2  # LLM-PQ's assumption: half of the maximum
    else:
        raise CliError("give --output-tokens, --length-distribution or --max-output-tokens")
    with bad_input():
        return Workload(
            args.batch_size, args.prompt_len, max(1, round(n)), args.kv_bits, args.bits, args.theta
        )


def _add_workload(p: argparse.ArgumentParser, theta: float) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--batch-size", type=_positive, default=32, help="batch size B (default 32)")
    g.add_argument(
        "--prompt-len", type=_positive, default=512, help="prompt length s in tokens (default 512)"
    )
    g.add_argument("--output-tokens", type=_positive, help="expected generated tokens n per query")
    g.add_argument(
        "--length-distribution", help="JSON file with the predictor's length distribution; its mean is n"
    )
    g.add_argument("--max-output-tokens", type=_positive, help="n = half of this (LLM-PQ's assumption)")
    g.add_argument(
        "--bits", type=_bits, default=DEFAULT_BITS, help="weight bit widths to choose from (default 3,4,8,16)"
    )
    g.add_argument(
        "--kv-bits", type=int, choices=(4, 8, 16), default=16, help="KV cache bit width (default 16)"
    )
    g.add_argument(
        "--theta",
        type=float,
        default=theta,
        help="quality knob: seconds of batch latency worth quantizing the whole model to the lowest bit width "
        f"(omega is normalised so that costs 1; default {theta})",
    )


def _profiles(items: list[str] | None) -> dict:
    out = {}
    for it in items or []:
        if "=" in it:
            dev, path = it.split("=", 1)
        else:
            dev, path = None, it
        with bad_input():
            prof = Profile.load(path)
        out[dev or prof.device] = prof
    return out


def cmd_plan(args: argparse.Namespace) -> int:
    with bad_input(ClusterSpecError, ValueError):
        cluster = load_cluster(args.cluster_spec)
        shape = load_shape(args.shape)
        problem = build_problem(
            cluster,
            shape,
            _workload(args),
            args.indicator,
            _profiles(args.profile),
            head_split=args.head_split,
        )
    out_folder(args.out)  # the inputs checked, before the solve
    log.info("planning %s on %s with %s", shape.name, cluster.describe(), args.method)
    t0 = time.perf_counter()
    if args.method in ("uniform", "het"):
        r = (uniform if args.method == "uniform" else het)(problem)
        res = None if r is None else (r[0], r[1], time.perf_counter() - t0)
    else:
        base = het(problem) if args.method == "ilp" else None  # an incumbent: never worse than Het
        sr = plan(
            problem,
            args.method,
            time_limit_s=args.time_limit,
            group_size=args.group_size,
            omega_budget=args.omega_budget,
            starts=[base[0]] if base else None,
            kappas=list(args.prefill_chunks) if args.prefill_chunks else None,
            tp_sizes=args.tp_sizes,
            stages=args.stages,
        )
        res = None if sr is None else (sr.assignment, sr.evaluation, sr.solve_seconds)
    if res is None:
        raise CliError(f"no plan fits: {shape.name} with this workload does not fit in {cluster.describe()}")
    pl = make_plan(problem, res[0], res[1], args.method, res[2])
    with writing("--out", args.out):
        save_plan(pl, args.out)
    for k, st in enumerate(pl.stages):
        d = pl.devices[st.device_index]
        tp = len(st.devices_of_stage)
        print(
            f"stage {k}: {d['type']:9s}{f' x{tp}' if tp > 1 else ''} layers [{st.layer_start:3d},{st.layer_end:3d}) bits {sorted(set(st.bits))} "
            f"mem {st.predicted_memory_bytes / 2**30:6.2f} GiB prefill {st.predicted_prefill_s * 1e3:8.2f} ms "
            f"decode {st.predicted_decode_s * 1e3:7.3f} ms"
        )
    if pl.head_split:
        print(f"LM head: {pl.head_split:.1%} of its rows on stage 0, the rest on stage {len(pl.stages) - 1}")
    summary = {
        "plan": str(args.out),
        "method": pl.method,
        "stages": len(pl.stages),
        "prefill_micro_batch": pl.prefill_micro_batch,
        "decode_micro_batch": pl.decode_micro_batch,
        "prefill_chunks": res[0].kappa,
        "tensor_parallel": [len(st.devices_of_stage) for st in pl.stages],
        "total_omega": pl.total_omega,
        "predicted_batch_latency_s": pl.predicted_batch_latency_s,
        "predicted_throughput_tokens_per_s": pl.predicted_throughput_tokens_per_s,
        "solve_seconds": pl.solve_seconds,
        "head_split": pl.head_split,
    }
    print(json.dumps(summary))
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    clusters = args.cluster_specs.split(",") if args.cluster_specs else list(PAPER_CLUSTERS)
    models = args.shapes.split(",")
    with bad_input(ClusterSpecError, ValueError):
        for c in clusters:
            load_cluster(c)
        for m in models:
            load_shape(m)
        wl = _workload(args)
    rows, summary = run_compare(
        clusters,
        models,
        wl,
        args.time_limit,
        progress=not args.no_progress,
        group_size=args.group_size,
        kappas=args.prefill_chunks,
        tp_sizes=args.tp_sizes,
    )
    table = markdown_table(rows)
    print(table)
    if args.markdown:
        Path(args.markdown).write_text(table)
    if args.plot:
        plot_speedups(rows, args.plot)
        summary["plot"] = args.plot
    summary["theta"] = wl.theta
    summary["time_limit_s"] = args.time_limit
    print(json.dumps(summary))
    return 0


def _add_tp_sizes(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tp-sizes",
        type=_tp_sizes,
        default=(1, 2, 4),
        help="tensor-parallel group sizes a stage may use (same-type devices on one node; default 1,2,4; "
        "1 = pipeline only)",
    )


def build_parser(prog: str = "fleetbatch planner") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=prog,
        description="Phase-aware planner for pipelines of unlike GPUs: device order, layers per device, bit "
        "width per layer, prefill/decode micro-batch sizes (ILP in OR-Tools CP-SAT, heuristics, baselines).",
    )
    ap.add_argument("-v", "--verbose", action="store_true", help="log progress (INFO)")
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("plan", help="plan one cluster and write plan.json")
    p.add_argument(
        "--cluster-spec",
        required=True,
        help="cluster spec file (YAML/JSON) or shorthand like 3xT4+V100 or 1xCPU",
    )
    p.add_argument(
        "--shape",
        required=True,
        help="opt-13b, opt-30b, opt-66b, llama3-8b, arch:size (localmodels) or a config.json",
    )
    p.add_argument(
        "--method", choices=PLAN_METHODS, default="ilp", help="ilp (default), transfer, adabits, uniform, het"
    )
    p.add_argument(
        "--time-limit",
        type=float,
        default=6.0,
        help="seconds for the search after scoring the candidates (default 6)",
    )
    p.add_argument("--group-size", type=_positive, help="layers per ILP group (default: at most 16 groups)")
    p.add_argument("--omega-budget", type=float, help="cap on total omega (raw indicator units)")
    p.add_argument(
        "--prefill-chunks",
        type=_chunks,
        help="numbers of prefill chunks kappa to consider (SplitQuant's chunked prefill), e.g. 1,2,4,8; "
        "1 = unchunked (default: 1,2,4,8 where a chunk keeps >= 64 prompt tokens)",
    )
    _add_tp_sizes(p)
    p.add_argument(
        "--stages",
        type=_positive,
        help="exactly this many pipeline stages (default: any number; devices may be left unused)",
    )
    p.add_argument(
        "--head-split",
        action="store_true",
        help="let the first stage compute a share of the LM head's vocabulary rows, balancing it with "
        "the last stage (run by the native engine's pipeline; vLLM keeps the head on the last stage)",
    )
    p.add_argument("--indicator", help="omega file from quant (default: quant's synthetic indicator)")
    p.add_argument(
        "--profile", action="append", help="DEVICE_TYPE=profile.json measured profile (repeatable)"
    )
    p.add_argument("--out", default="plan.json", help="where to write the plan (default plan.json)")
    _add_workload(p, theta=1.0)
    p.set_defaults(func=cmd_plan)

    c = sub.add_parser("compare", help="benchmark: ours vs Uniform and Het over the papers' clusters")
    c.add_argument("--cluster-specs", help=f"comma-separated clusters (default: {','.join(PAPER_CLUSTERS)})")
    c.add_argument("--shapes", default="opt-13b,opt-30b,opt-66b", help="comma-separated models")
    c.add_argument("--time-limit", type=float, default=6.0, help="seconds of search per plan (default 6)")
    c.add_argument("--group-size", type=_positive, help="layers per ILP group (default: at most 16 groups)")
    c.add_argument(
        "--prefill-chunks",
        type=_chunks,
        help="prefill chunk counts kappa our plan may use (default 1,2,4,8; 1 = no chunked prefill)",
    )
    _add_tp_sizes(c)
    c.add_argument("--markdown", help="also write the table to this file")
    c.add_argument("--plot", help="save a bar chart of the speedups (PNG)")
    c.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_workload(c, theta=1.0)
    c.set_defaults(func=cmd_compare, output_tokens=100)

    add_measure_parsers(sub)
    add_fleet_parser(sub)
    return ap


def main(argv: list[str] | None = None, prog: str = "fleetbatch planner") -> int:
    spec = {"errors": (CliError,), "log_format": PLAIN_LOG, "levels": (logging.WARNING, logging.INFO)}
    return run_main(build_parser(prog), argv, lambda args: args.func(args), prog=prog, **spec)


if __name__ == "__main__":
    sys.exit(main())
