"""``planner`` command line: ``plan``, ``compare``, ``profile``, ``fidelity``.

Benchmarks (``compare``, ``fidelity``) print one JSON object as their last line.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
from pathlib import Path

from planner.cluster import PAPER_CLUSTERS, ClusterSpecError, load_cluster
from planner.costs import DEFAULT_BITS, Workload

log = logging.getLogger("planner")

PLAN_METHODS = ("ilp", "transfer", "adabits", "uniform", "het")


class CliError(Exception):
    """Bad input: reported as one line, exit status 2."""


def _int_set(text: str, what: str, example: str) -> tuple[int, ...]:
    """Sorted distinct integers of a comma-separated option value (``what``/``example`` name it in errors)."""
    try:
        return tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what} must be integers like {example}, got {text!r}") from None


def _bits(text: str) -> tuple[int, ...]:
    bits = _int_set(text, "bit widths", "3,4,8,16")
    if not bits or any(b not in (2, 3, 4, 8, 16) for b in bits):
        raise argparse.ArgumentTypeError(f"bit widths must be among 2,3,4,8,16, got {text!r}")
    return bits


def _chunks(text: str) -> tuple[int, ...]:
    ks = _int_set(text, "prefill chunks", "1,2,4")
    if not ks or min(ks) < 1:
        raise argparse.ArgumentTypeError(f"prefill chunks must be >= 1, got {text!r}")
    return ks


def _tp_sizes(text: str) -> tuple[int, ...]:
    vals = _int_set(text, "tensor-parallel sizes", "1,2,4")
    if not vals or any(v not in (1, 2, 4) for v in vals):
        raise argparse.ArgumentTypeError(f"tensor-parallel sizes must be among 1, 2, 4, got {text!r}")
    return vals


def _sizes(text: str) -> tuple[int, ...]:
    """``--batches`` / ``--lengths`` of ``planner profile``: distinct positive integers."""
    vals = _int_set(text, "grid sizes", "8,16,32")
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"grid sizes must be positive integers like 8,16,32, got {text!r}")
    return vals


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


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
    try:
        return Workload(args.batch, args.prompt_len, max(1, round(n)), args.kv_bits, args.bits, args.theta)
    except ValueError as e:
        raise CliError(str(e)) from None


def _add_workload(p: argparse.ArgumentParser, theta: float) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--batch", type=_positive, default=32, help="batch size B (default 32)")
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
    from planner.latency import Profile

    out = {}
    for it in items or []:
        if "=" in it:
            dev, path = it.split("=", 1)
        else:
            dev, path = None, it
        try:
            prof = Profile.load(path)
        except ValueError as e:
            raise CliError(str(e)) from None
        out[dev or prof.device] = prof
    return out


def cmd_plan(args: argparse.Namespace) -> int:
    from planner.baselines import het, uniform
    from planner.build import make_plan
    from planner.modelshape import load_shape
    from planner.planfile import save_plan
    from planner.problem import build_problem
    from planner.search import plan

    try:
        cluster = load_cluster(args.cluster)
        shape = load_shape(args.model)
        problem = build_problem(cluster, shape, _workload(args), args.indicator, _profiles(args.profile))
    except (ClusterSpecError, ValueError) as e:
        raise CliError(str(e)) from None
    log.info("planning %s on %s with %s", shape.name, cluster.describe(), args.method)
    import time

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
    save_plan(pl, args.out)
    for k, st in enumerate(pl.stages):
        d = pl.devices[st.device_index]
        tp = len(st.devices_of_stage)
        print(
            f"stage {k}: {d['type']:9s}{f' x{tp}' if tp > 1 else ''} layers [{st.layer_start:3d},{st.layer_end:3d}) bits {sorted(set(st.bits))} "
            f"mem {st.predicted_memory_bytes / 2**30:6.2f} GiB prefill {st.predicted_prefill_s * 1e3:8.2f} ms "
            f"decode {st.predicted_decode_s * 1e3:7.3f} ms"
        )
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
    }
    print(json.dumps(summary))
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from planner.compare import markdown_table, plot_speedups, run_compare

    clusters = args.clusters.split(",") if args.clusters else list(PAPER_CLUSTERS)
    models = args.models.split(",")
    try:
        for c in clusters:
            load_cluster(c)
        from planner.modelshape import load_shape

        for m in models:
            load_shape(m)
        wl = _workload(args)
    except (ClusterSpecError, ValueError) as e:
        raise CliError(str(e)) from None
    rows, summary = run_compare(
        clusters,
        models,
        wl,
        args.time_limit,
        progress=not args.quiet,
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


def cmd_profile(args: argparse.Namespace) -> int:
    from planner.modelshape import load_shape
    from planner.profiler import profile_local

    try:
        shape = load_shape(args.model)
    except ValueError as e:
        raise CliError(str(e)) from None
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise CliError("--device cuda given but no CUDA GPU is available")
    pre_grid, dec_grid = _profile_grids(args)
    try:
        prof = profile_local(
            shape,
            args.device,
            args.threads,
            pre_grid,
            dec_grid,
            args.reps,
            progress=not args.quiet,
            clock=args.clock,
            min_time_s=args.min_time,
        )
    except ValueError as e:
        raise CliError(str(e)) from None
    prof.save(args.out)
    from planner.latency import fit_head, fit_profile

    ph = prof.samples[16]
    try:
        lm = fit_profile(prof)
        pre, dec = lm.prefill_coef[16], lm.decode_coef[16]
    except ValueError as e:  # a grid too small to fit the layer model: the profile is still written
        print(f"planner profile: warning: {e}; `planner plan` cannot use this profile", file=sys.stderr)
        pre = dec = None
    print(
        json.dumps(
            {
                "profile": str(args.out),
                "device": prof.device,
                "model": shape.name,
                "prefill_coef": pre,
                "decode_coef": dec,
                "head_coef": fit_head(ph.get("head", [])),
                "points": len(ph["prefill"]) + len(ph["decode"]),
                "head_points": len(ph.get("head", [])),
                "clock": prof.meta["clock"],
                "reps": prof.meta["reps"],
                "median_spread": prof.meta["median_spread"],
                "wall_s": prof.meta["wall_s"],
                "process_cpu_s": prof.meta["process_cpu_s"],
            }
        )
    )
    return 0


QUICK_BATCHES = (1, 2, 4)
QUICK_LENGTHS = (64, 128, 256)


def _profile_grids(args: argparse.Namespace) -> tuple[list | None, list | None]:
    """Prefill (v x s) and decode (v x c) grids of ``planner profile``: ``--batches`` x ``--lengths``,
    each defaulting to the ``--quick`` sizes, else to the profiler's; (None, None) for the full default."""
    from planner import profiler

    batches = args.batches or (QUICK_BATCHES if args.quick else None)
    lengths = args.lengths or (QUICK_LENGTHS if args.quick else None)
    if batches is None and lengths is None:
        return None, None
    pre = [(v, s) for v in batches or profiler.PREFILL_BATCHES for s in lengths or profiler.PREFILL_LENGTHS]
    dec = [(v, c) for v in batches or profiler.DECODE_BATCHES for c in lengths or profiler.DECODE_CONTEXTS]
    return pre, dec


def cmd_fidelity(args: argparse.Namespace) -> int:
    from planner.catalog import device_type
    from planner.fidelity import fidelity_profile, latency_errors, memory_errors
    from planner.latency import paper_ratio_check
    from planner.modelshape import load_shape

    try:
        shape = load_shape(args.model)
        mem_shape = load_shape(args.memory_model)
    except ValueError as e:
        raise CliError(str(e)) from None
    try:
        prof = fidelity_profile(
            shape,
            args.threads,
            args.reps,
            progress=not args.quiet,
            clock=args.clock,
            min_time_s=args.min_time,
        )
    except ValueError as e:
        raise CliError(str(e)) from None
    if args.save_profile:
        prof.save(args.save_profile)
    lat = latency_errors(prof)
    n = mem_shape.layers
    cycle = (16, 8, 4, 3)
    mem = memory_errors(mem_shape, [cycle[i % 4] for i in range(n)])
    ratios = paper_ratio_check(load_shape("opt-13b"), device_type("P100"), device_type("V100"))
    out = {
        "model": shape.name,
        "memory_model": mem_shape.name,
        "threads": args.threads,
        "clock": prof.meta["clock"],
        "reps": prof.meta["reps"],
        "statistic": prof.meta["statistic"],
        "median_spread": prof.meta["median_spread"],
        "profile_wall_s": prof.meta["wall_s"],
        "profile_process_cpu_s": prof.meta["process_cpu_s"],
        **lat,
        **mem,
        **ratios,
    }
    print(
        f"latency ({prof.meta['clock']} clock, min of {prof.meta['reps']} shuffled rounds): prefill mean error "
        f"{lat['prefill_mean_error']:.2%}, decode {lat['decode_mean_error']:.2%}, "
        f"mean {lat['mean_latency_error']:.2%}"
    )
    print(f"memory: weights error {mem['weights_error']:.3%}, KV error {mem['kv_error']:.3%}")
    print(
        f"roofline P100/V100: prefill {ratios['prefill_ratio']:.2f}x (paper 14.53x), decode {ratios['decode_ratio']:.2f}x (paper 7.29x)"
    )
    print(json.dumps(out))
    return 0


def _add_timing_arguments(p: argparse.ArgumentParser, reps: int, min_time: float) -> None:
    """Options of ``profile`` and ``fidelity``: how each grid point is timed."""
    p.add_argument(
        "--reps",
        type=_positive,
        default=reps,
        help="rounds over the grid (shuffled); each point keeps its minimum",
    )
    p.add_argument(
        "--clock",
        choices=("thread", "process", "wall"),
        help="timer: thread = CPU time of the profiling thread (default on CPU with 1 thread: blind to time "
        "other jobs take on a shared machine), process, wall (default on GPU or with several threads)",
    )
    p.add_argument(
        "--min-time",
        type=float,
        default=min_time,
        help=f"seconds of calls per point and round (short calls repeat; the fastest is kept; default {min_time})",
    )


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="planner",
        description="Phase-aware planner for pipelines of unlike GPUs: device order, layers per device, bit "
        "width per layer, prefill/decode micro-batch sizes (ILP in OR-Tools CP-SAT, heuristics, baselines).",
    )
    ap.add_argument("-v", "--verbose", action="store_true", help="log progress (INFO)")
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("plan", help="plan one cluster and write plan.json")
    p.add_argument(
        "--cluster", required=True, help="cluster spec file (YAML/JSON) or shorthand like 3xT4+V100 or 1xCPU"
    )
    p.add_argument(
        "--model",
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
    p.add_argument(
        "--tp-sizes",
        type=_tp_sizes,
        default=(1, 2, 4),
        help="tensor-parallel group sizes a stage may use (same-type devices on one node; default 1,2,4; "
        "1 = pipeline only)",
    )
    p.add_argument(
        "--stages",
        type=_positive,
        help="exactly this many pipeline stages (default: any number; devices may be left unused)",
    )
    p.add_argument("--indicator", help="omega file from quant (default: quant's synthetic indicator)")
    p.add_argument(
        "--profile", action="append", help="DEVICE_TYPE=profile.json measured profile (repeatable)"
    )
    p.add_argument("--out", default="plan.json", help="where to write the plan (default plan.json)")
    _add_workload(p, theta=1.0)
    p.set_defaults(func=cmd_plan)

    c = sub.add_parser("compare", help="benchmark: ours vs Uniform and Het over the papers' clusters")
    c.add_argument("--clusters", help=f"comma-separated clusters (default: {','.join(PAPER_CLUSTERS)})")
    c.add_argument("--models", default="opt-13b,opt-30b,opt-66b", help="comma-separated models")
    c.add_argument("--time-limit", type=float, default=6.0, help="seconds of search per plan (default 6)")
    c.add_argument("--group-size", type=_positive, help="layers per ILP group (default: at most 16 groups)")
    c.add_argument(
        "--prefill-chunks",
        type=_chunks,
        help="prefill chunk counts kappa our plan may use (default 1,2,4,8; 1 = no chunked prefill)",
    )
    c.add_argument(
        "--tp-sizes",
        type=_tp_sizes,
        default=(1, 2, 4),
        help="tensor-parallel group sizes a stage may use (same-type devices on one node; default 1,2,4; "
        "1 = pipeline only)",
    )
    c.add_argument("--markdown", help="also write the table to this file")
    c.add_argument("--plot", help="save a bar chart of the speedups (PNG)")
    c.add_argument("--quiet", action="store_true", help="no progress bar")
    _add_workload(c, theta=1.0)
    c.set_defaults(func=cmd_compare, output_tokens=100)

    f = sub.add_parser(
        "profile",
        help="time one decoder layer (prefill, decode) and the LM head on this machine over a grid; "
        "write a profile",
        description="Time one decoder layer of the model shape over a prefill grid (batch v x prompt "
        "length s) and a decode grid (batch v x cached tokens c), and the LM head (final norm + "
        "hidden -> vocab projection) on v tokens for every decode batch v; write the profile and print "
        "the fitted coefficients as one JSON line.",
    )
    f.add_argument("--model", default="llama:small", help="model shape to profile (default llama:small)")
    f.add_argument("--device", default="cpu", help="cpu or cuda")
    f.add_argument(
        "--threads", type=int, default=1, help="CPU threads (default 1: steadier on a shared machine)"
    )
    _add_timing_arguments(f, reps=3, min_time=0.05)
    f.add_argument(
        "--quick",
        action="store_true",
        help=f"a small grid: batches {','.join(map(str, QUICK_BATCHES))} x lengths "
        f"{','.join(map(str, QUICK_LENGTHS))} (seconds); --batches / --lengths override its sizes",
    )
    f.add_argument(
        "--batches",
        type=_sizes,
        help="micro-batch sizes v of the prefill and decode grids (and the LM head), e.g. 8,16,32,64 "
        "(default 1,2,4,8; with --quick 1,2,4)",
    )
    f.add_argument(
        "--lengths",
        type=_sizes,
        help="prompt lengths s of the prefill grid and cached tokens c of the decode grid, e.g. "
        "64,128,256 (default 128,256,512,1024; with --quick 64,128,256)",
    )
    f.add_argument("--quiet", action="store_true", help="no progress bar")
    f.add_argument("--out", default="profile.json", help="where to write the profile (default profile.json)")
    f.set_defaults(func=cmd_profile)

    d = sub.add_parser(
        "fidelity", help="benchmark: cost-model errors on this CPU (latency on unseen shapes, memory)"
    )
    d.add_argument("--model", default="llama:small", help="shape whose layer is timed (default llama:small)")
    d.add_argument("--memory-model", default="llama:small", help="model built to check the memory model")
    d.add_argument("--threads", type=int, default=1)
    _add_timing_arguments(d, reps=8, min_time=0.3)
    d.add_argument("--save-profile", help="also write the measured profile")
    d.add_argument("--quiet", action="store_true")
    d.set_defaults(func=cmd_fidelity)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        return args.func(args)
    except CliError as e:
        print(f"planner {args.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
