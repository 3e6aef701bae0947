"""``fleetbatch sim study|scale|validate|deadlines|spot-replay|spot-scale`` (or ``python -m sim.cli``): MICO's study and the scale run in cost-model time.

The last line of the output is one JSON object (see ``docs/design/sim.md``).
"""

from __future__ import annotations

import argparse
import sys

from cliutil import run_main
from gateway.assign.cost import SPOT_MARGIN
from load.arrivals import add_arrival_arguments
from sim import deadlines, spot_replay, spot_scale
from sim.costs import LinearCost, parse_speeds
from sim.study import StudySetup, make_workloads, scale, study
from sim.validate import __doc__ as validate_doc
from sim.validate import validate


def _ints(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, not {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, not {text!r}")
    return vals


def _cost_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "cost model (seconds of a speed-1 cluster; a step = overhead + prefill + decode)"
    )
    g.add_argument(
        "--prefill-per-token",
        type=float,
        default=LinearCost.prefill_per_token_s,
        metavar="S",
        help=f"seconds per prompt token prefilled (default {LinearCost.prefill_per_token_s})",
    )
    g.add_argument(
        "--decode-per-seq",
        type=float,
        default=LinearCost.decode_per_seq_s,
        metavar="S",
        help=f"seconds per query decoding one token (default {LinearCost.decode_per_seq_s})",
    )
    g.add_argument(
        "--step-overhead",
        type=float,
        default=LinearCost.step_overhead_s,
        metavar="S",
        help=f"fixed seconds per engine step (default {LinearCost.step_overhead_s})",
    )
    g.add_argument(
        "--profile",
        default=None,
        metavar="PROFILE.json",
        help="linearise a planner/engine profile of one decoder layer instead (with --layers)",
    )
    g.add_argument(
        "--layers", type=int, default=32, help="decoder layers of the model, with --profile (default 32)"
    )
    p.add_argument("--speeds", default="1,2,4", help="speeds of the unequal fleet, repeated (default 1,2,4)")
    p.add_argument(
        "--kv-budget-tokens",
        type=int,
        default=16384,
        help="KV tokens per iteration-level engine (default 16384)",
    )
    p.add_argument("--max-tokens", type=int, default=256, help="response cap of the workload (default 256)")
    p.add_argument("--no-offload", action="store_true", help="turn the backoff offloader off")
    p.add_argument("--seed", type=int, default=0, help="workload and arrival seed (default 0)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _scale_args(p: argparse.ArgumentParser) -> None:
    """The scale runs' fleet and workload size (``scale``, ``spot-scale``)."""
    p.add_argument("--num-clusters", type=int, default=100, help="iteration-level clusters (default 100)")
    p.add_argument(
        "-n", "--num-queries", type=int, default=1_000_000, help="queries, all at once (default 1,000,000)"
    )
    p.add_argument("--max-running", type=int, default=8, help="engine batch size (max_running; default 8)")


def _check_scale(args: argparse.Namespace) -> None:
    if args.num_clusters < 1 or args.num_queries < 1 or args.max_running < 1:
        raise ValueError("--num-clusters, --num-queries and --max-running must be >= 1")


def _setup(args: argparse.Namespace) -> StudySetup:
    if args.profile:
        cost = LinearCost.from_profile(args.profile, args.layers)
    else:
        cost = LinearCost(args.prefill_per_token, args.decode_per_seq, args.step_overhead)
    return StudySetup(
        cost=cost,
        kv_budget_tokens=args.kv_budget_tokens,
        offload=not args.no_offload,
        speeds=tuple(parse_speeds(args.speeds)),
        max_tokens=args.max_tokens,
    )


def build_parser(prog: str = "fleetbatch sim") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Discrete-event simulation of a fleet in cost-model time, driving the real assigner, "
        "offloading decision and engine scheduler.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser(
        "study",
        help="MICO's four combinations {round_robin, token} x {static, iteration} and the 3/6/9-cluster replay",
        description="Runs {round_robin, token} x {static batches, iteration-level} on 3 equal clusters and on "
        "3 clusters at --speeds, for every engine batch size of --batches and batch length of --num-queries; "
        "then the four combinations at each of --cluster-counts. Prints a table; the last line is JSON.",
    )
    s.add_argument(
        "--workload", choices=("generated", "mixed"), default="mixed", help="query source (default mixed)"
    )
    s.add_argument(
        "-n",
        "--num-queries",
        type=_ints,
        default=[200, 500, 1000],
        help="batch lengths (default 200,500,1000)",
    )
    s.add_argument(
        "--batches", type=_ints, default=[2, 4, 6, 8, 10], help="engine batch sizes (default 2,4,6,8,10)"
    )
    s.add_argument("--reference-batch", type=int, default=8, help="engine batch size of the cluster replay")
    s.add_argument(
        "--cluster-counts", type=_ints, default=[3, 6, 9], help="fleet sizes replayed (default 3,6,9)"
    )
    add_arrival_arguments(s)
    _cost_args(s)
    c = sub.add_parser(
        "scale",
        help="time the simulator: 100 clusters x 1,000,000 queries by default",
        description="Simulates --num-queries queries (resampled from the generated workload, all at once) on "
        "--clusters iteration-level clusters at --speeds with the token policy and offloading, and reports "
        "the wall-clock seconds of the simulation (sim_seconds_100x1m for the default size).",
    )
    _scale_args(c)
    c.add_argument(
        "--policy",
        choices=("token", "round_robin"),
        default="token",
        help="assignment policy (default token)",
    )
    _cost_args(c)
    v = sub.add_parser(
        "validate",
        help="sim_makespan_error: replay real `fleetbatch loadgen study` runs in cost-model time",
        description=validate_doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    v.add_argument(
        "runs",
        nargs="+",
        help="run directories of `fleetbatch loadgen study` (iteration-level setups) or of `fleetbatch loadgen study --planned`",
    )
    _cost_args(v)
    r = sub.add_parser(
        "spot-replay",
        help="sim_cost_error, sim_makespan_error: replay `fleetbatch loadgen spot` runs (prices, notices, resumes)",
        description=spot_replay.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    r.add_argument("runs", nargs="+", help="run directories of `fleetbatch loadgen spot` (one per setup)")
    ss = sub.add_parser(
        "spot-scale",
        help="the scale run with prices and synthetic preemptions, CPU-timed beside the plain scale run",
        description=spot_scale.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _scale_args(ss)
    ss.add_argument(
        "--policy", choices=("token", "cost"), default="token", help="the spot run's policy (default token)"
    )
    ss.add_argument(
        "--preempts-per-hour",
        type=float,
        default=6.0,
        help="preemptions of each spot cluster per hour of simulated time, on average (default 6)",
    )
    ss.add_argument("--notice", type=float, default=1.0, help="seconds of each notice (default 1)")
    ss.add_argument(
        "--back-after",
        type=float,
        default=60.0,
        help="seconds from an engine's stop until it is back (default 60)",
    )
    ss.add_argument(
        "--kill-share",
        type=float,
        default=0.2,
        help="share of the preemptions that are hard kills (default 0.2)",
    )
    ss.add_argument(
        "--window",
        type=float,
        default=2.0,
        help="the batch's window, times the plain run's makespan (default 2)",
    )
    ss.add_argument("--repeats", type=int, default=3, help="runs of each, alternately (default 3)")
    ss.add_argument(
        "--spot-margin",
        type=float,
        default=SPOT_MARGIN,
        help=f"with --policy cost: the spot clusters' share done within this share of the window (default {SPOT_MARGIN})",
    )
    _cost_args(ss)
    d = sub.add_parser(
        "deadlines",
        help="fleetbatch loadgen deadlines' scenario makespan and its runs replayed (deadline order, expiry)",
        description=deadlines.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    deadlines.add_arguments(d)
    return parser


def _table(out: dict) -> str:
    lines = [
        f"{'clusters':>8} {'fleet':>7} {'combination':<24} {'makespan s':>11} {'tokens/s':>10} {'KV tok*s':>12}"
    ]
    for k, d in out["clusters"].items():
        for fleet_name in ("equal", "unequal"):
            for combo, s in d[fleet_name].items():
                lines.append(
                    f"{k:>8} {fleet_name:>7} {combo:<24} {s['makespan_s']:>11.2f} "
                    f"{s['throughput_tokens_per_s']:>10.1f} {s['kv_token_seconds']:>12.0f}"
                )
        lines.append(
            f"{k:>8} ratios: qi/rr_static {d['qi_over_rr_static']:.2f}, token/rr iteration 1:2:4 "
            f"{d['qi_over_rr_iteration_unequal']:.2f}, KV iteration/static {d['kv_ratio_iteration_vs_static']:.2f}"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict:
    """The chosen command's result (the JSON object of the last line); validate and study print a table first."""
    if args.command == "deadlines":
        return deadlines.run(args)
    if args.command == "spot-replay":
        out = spot_replay.replay(args.runs)
        for r in out["runs"]:
            print(
                f"{r['run']:<50} cost real {r['real_cost_dollars']:.4f} sim {r['sim_cost_dollars']:.4f}  "
                f"makespan real {r['real_makespan_s']:.1f} s sim {r['sim_makespan_s']:.1f} s"
            )
        return out
    setup = _setup(args)
    if args.command == "spot-scale":
        _check_scale(args)
        return spot_scale.scale_spot(
            args.num_clusters,
            args.num_queries,
            args.max_running,
            setup,
            args.seed,
            args.policy,
            args.preempts_per_hour,
            args.notice,
            args.back_after,
            args.kill_share,
            args.window,
            args.repeats,
            not args.no_progress,
            args.spot_margin,
        )
    if args.command == "validate":
        out = validate(args.runs, setup.cost)
        for r in out["runs"]:
            print(
                f"{r['run']:<50} real {r['real_makespan_s']:>7.2f} s  sim {r['sim_makespan_s']:>7.2f} s  error {r['error']:.3f}"
            )
    elif args.command == "study":
        works = make_workloads(
            args.workload,
            args.num_queries,
            args.seed,
            args.max_tokens,
            args.arrivals,
            args.rate,
            args.arrival_scale,
            args.trace,
        )
        out = study(
            works, args.batches, args.cluster_counts, setup, args.reference_batch, not args.no_progress
        )
        out.update(workload=args.workload, arrivals=args.arrivals, offload=setup.offload)
        print(_table(out))
    else:
        _check_scale(args)
        out = scale(
            args.num_clusters,
            args.num_queries,
            args.max_running,
            setup,
            args.seed,
            args.policy,
            not args.no_progress,
        )
    return out


def main(argv: list[str] | None = None, prog: str = "fleetbatch sim") -> int:
    errors, message = (ValueError, FileNotFoundError), "error: {error}"
    return run_main(build_parser(prog), argv, run, prog=prog, errors=errors, message=message, print_json=True)


if __name__ == "__main__":
    sys.exit(main())
