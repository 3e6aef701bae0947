"""``fleetbatch planner fleet``: plan every cluster of a fleet file on its devices as emulated on this machine."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from planner.cli_args import CliError, _bits, bad_input
from planner.cluster import ClusterSpecError
from planner.fleet import DEFAULT_BITS, load_fleet
from planner.fleet_plans import METHODS, FleetJob, default_workload, plan_fleet
from planner.latency import Profile
from planner.modelshape import load_shape


def cmd_fleet(args: argparse.Namespace) -> int:
    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    bad = [m for m in methods if m not in METHODS]
    if not methods or bad:
        raise CliError(f"--methods: choose from {', '.join(METHODS)}, not {args.methods!r}")
    if args.kv_budget_tokens < 1:
        raise CliError(f"--kv-tokens must be >= 1, got {args.kv_budget_tokens}")
    with bad_input(ClusterSpecError, ValueError):
        job = FleetJob(
            fleet=load_fleet(args.clusters),
            shape=load_shape(args.shape),
            profile=Profile.load(args.profile),
            workload=default_workload(args.batch_size, args.prompt_len, args.output_tokens, args.bits),
            methods=methods,
            kv_tokens=args.kv_budget_tokens,
            time_limit_s=args.time_limit,
        )
        summary = plan_fleet(job, Path(args.out))
    print(json.dumps(summary))
    return 0


def add_fleet_parser(sub) -> None:
    f = sub.add_parser(
        "fleet",
        help="plan every cluster of a cluster file (catalog devices emulated on this CPU); write plan files",
        description=(
            "Read a cluster file whose clusters name catalog devices (e.g. '{name: fast, devices: [A100-40G, "
            "A100-40G]}'; docs/reference/cluster-file.md), map each device onto this machine (this CPU's profile of the served model, "
            "scaled by the device's catalog ratios; a memory budget scaled from the reference model), "
            "and plan every cluster by each method. Writes OUT/CLUSTER.METHOD.json (plans carrying their "
            "devices' cost models, for `fleetbatch engine serve --plan P --device-cost plan`) and OUT/fleet-plans.json; "
            "prints that summary as the last line. Cached: the same inputs are not solved twice."
        ),
    )
    f.add_argument(
        "clusters",
        metavar="FILE",
        help="the cluster file (YAML/JSON), or 'default' (fast: 2xA100-40G, medium: V100-32G+T4, slow: 2xT4)",
    )
    f.add_argument("--shape", default="llama:micro", help="the served model's shape (default llama:micro)")
    f.add_argument(
        "--profile",
        required=True,
        help="this CPU's profile of the served model (`fleetbatch engine profile`)",
    )
    f.add_argument("--methods", default="ilp", help=f"comma-separated, of {', '.join(METHODS)} (default ilp)")
    f.add_argument("--out", default="plans", help="directory of the plan files (default plans)")
    f.add_argument("--batch-size", type=int, default=16, help="queries of the planned workload (default 16)")
    f.add_argument("--prompt-len", type=int, default=128, help="mean prompt tokens (default 128)")
    f.add_argument("--output-tokens", type=int, default=128, help="mean response tokens (default 128)")
    f.add_argument(
        "--bits", type=_bits, default=DEFAULT_BITS, help="bit widths a layer may take (default 4,8,16)"
    )
    f.add_argument(
        "--kv-budget-tokens", type=int, default=16384, help="the engines' KV cache in tokens (default 16384)"
    )
    f.add_argument(
        "--time-limit", type=float, default=6.0, help="seconds of ILP search per cluster (default 6)"
    )
    f.set_defaults(func=cmd_fleet)
