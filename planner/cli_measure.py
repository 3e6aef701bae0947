"""``fleetbatch planner profile`` and ``fleetbatch planner fidelity``: timing a decoder layer here, and the cost models' errors."""

from __future__ import annotations

import argparse
import json
import sys

from planner.catalog import device_type
from planner.cli_args import CliError, _positive, _sizes, bad_input, out_folder, writing
from planner.latency import fit_head, fit_profile, paper_ratio_check
from planner.modelshape import load_shape


def cmd_profile(args: argparse.Namespace) -> int:
    import torch  # here, not at the top: the planner's other commands run without torch

    from planner.profiler import profile_local

    out_folder(args.out)
    with bad_input():
        shape = load_shape(args.shape)
    if args.device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise CliError("--device cuda given but no CUDA GPU is available")
    pre_grid, dec_grid = _profile_grids(args)
    with bad_input():
        prof = profile_local(
            shape,
            args.device,
            args.threads,
            pre_grid,
            dec_grid,
            args.reps,
            progress=not args.no_progress,
            clock=args.clock,
            min_time_s=args.min_time,
        )
    with writing("--out", args.out):
        prof.save(args.out)
    ph = prof.samples[16]
    try:
        lm = fit_profile(prof)
        pre, dec = lm.prefill_coef[16], lm.decode_coef[16]
    except ValueError as e:  # a grid too small to fit the layer model: the profile is still written
        print(
            f"fleetbatch planner profile: warning: {e}; `fleetbatch planner plan` cannot use this profile",
            file=sys.stderr,
        )
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
    """Prefill (v x s) and decode (v x c) grids of ``fleetbatch planner profile``: ``--batches`` x ``--lengths``,
    each defaulting to the ``--quick`` sizes, else to the profiler's; (None, None) for the full default."""
    batches = args.batches or (QUICK_BATCHES if args.quick else None)
    lengths = args.lengths or (QUICK_LENGTHS if args.quick else None)
    if batches is None and lengths is None:
        return None, None
    from planner import profiler

    pre = [(v, s) for v in batches or profiler.PREFILL_BATCHES for s in lengths or profiler.PREFILL_LENGTHS]
    dec = [(v, c) for v in batches or profiler.DECODE_BATCHES for c in lengths or profiler.DECODE_CONTEXTS]
    return pre, dec


def cmd_fidelity(args: argparse.Namespace) -> int:
    from planner.fidelity import fidelity_profile, latency_errors, memory_errors

    with bad_input():
        shape = load_shape(args.shape)
        mem_shape = load_shape(args.memory_model)
    with bad_input():
        prof = fidelity_profile(
            shape,
            args.threads,
            args.reps,
            progress=not args.no_progress,
            clock=args.clock,
            min_time_s=args.min_time,
        )
    if args.save_profile:
        with writing("--save-profile", args.save_profile):
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


def add_measure_parsers(sub) -> None:
    """The ``profile`` and ``fidelity`` subcommands."""
    f = sub.add_parser(
        "profile",
        help="time one decoder layer (prefill, decode) and the LM head on this machine over a grid; "
        "write a profile",
        description="Time one decoder layer of the model shape over a prefill grid (batch v x prompt "
        "length s) and a decode grid (batch v x cached tokens c), and the LM head (final norm + "
        "hidden -> vocab projection) on v tokens for every decode batch v; write the profile and print "
        "the fitted coefficients as one JSON line.",
    )
    f.add_argument("--shape", default="llama:small", help="model shape to profile (default llama:small)")
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
    f.add_argument("--no-progress", action="store_true", help="no progress bar")
    f.add_argument("--out", default="profile.json", help="where to write the profile (default profile.json)")
    f.set_defaults(func=cmd_profile)

    d = sub.add_parser(
        "fidelity", help="benchmark: cost-model errors on this CPU (latency on unseen shapes, memory)"
    )
    d.add_argument("--shape", default="llama:small", help="shape whose layer is timed (default llama:small)")
    d.add_argument("--memory-model", default="llama:small", help="model built to check the memory model")
    d.add_argument("--threads", type=int, default=1)
    _add_timing_arguments(d, reps=8, min_time=0.3)
    d.add_argument("--save-profile", help="also write the measured profile")
    d.add_argument("--no-progress", action="store_true")
    d.set_defaults(func=cmd_fidelity)
