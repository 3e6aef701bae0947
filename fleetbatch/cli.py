"""``fleetbatch <part> <command>``: the parts of the project under one command.

The top parser knows the parts by name only (:data:`PARTS`), so ``fleetbatch --help`` and a part's command
start without importing the others. A part's own parser (``build_parser(prog)`` of its CLI module) does the
rest. Global options go before the part and reach every process the command starts, by the environment:
``-v`` (``FLEETBATCH_VERBOSE=1``: debug logging) and ``--log-format json|text`` (``FLEETBATCH_LOG_FORMAT``).
Exit status: 2 for a usage error (an unknown or malformed argument, as argparse reports it), 1 for every
other failure, with a one-line message naming the problem. ``fleetbatch completion bash|zsh|tcsh`` prints a
shell completion script for the whole tree (``shtab``).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version

from cliutil import LOG_FORMAT_ENV, VERBOSE_ENV

#: each part: (its CLI module, what it is for)
PARTS: dict[str, tuple[str, str]] = {
    "gateway": (
        "gateway.cli",
        "the gRPC gateway: serve, a local deployment (up), status, rebalance, prepare",
    ),
    "engine": (
        "engines.cli",
        "one cluster's engine: serve a queue, generate from JSONL, benchmarks, profile",
    ),
    "planner": (
        "planner.cli",
        "cluster layouts by the phase-aware ILP: plan, compare, fleet, profile, fidelity",
    ),
    "predictor": ("predictor.cli", "the response-length model: train, eval, bench, retrain, adapt"),
    "quant": ("quant.cli", "quantized layers: a tiny LM, the sensitivity indicator, exact bytes, perplexity"),
    "loadgen": (
        "load.cli",
        "load and studies: submit, demo, chaos, soak, study, wan, deadlines, prefix, report",
    ),
    "sim": (
        "sim.cli",
        "the fleet simulator in cost-model time: study, scale, validate, deadlines, spot-replay, spot-scale",
    ),
}


def _version() -> str:
    try:
        return version("fleetbatch")
    except PackageNotFoundError:  # run from a checkout that is not installed
        return "unknown"


def top_parser() -> argparse.ArgumentParser:
    """The global options and the parts by name (each part's arguments are its own parser's)."""
    p = argparse.ArgumentParser(
        prog="fleetbatch",
        description="Offline LLM inference across clusters of unlike GPUs. Each part is a subcommand; "
        "`fleetbatch PART --help` lists its commands.",
        epilog="parts:\n" + "\n".join(f"  {name:<10} {text}" for name, (_, text) in PARTS.items())
        + "\n  completion print a shell completion script (bash, zsh, tcsh)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    p.add_argument(
        "-v", "--verbose", action="store_true", help="debug logging, in this and every process it starts"
    )
    p.add_argument(
        "--log-format", choices=("text", "json"), default=None, help="log lines as text (default) or JSON"
    )
    p.add_argument("--version", action="version", version=f"fleetbatch {_version()}")
    p.add_argument("part", choices=[*PARTS, "completion"], metavar="PART", help="the part to run (see below)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the part's command and its arguments")
    return p


def part_parser(name: str) -> argparse.ArgumentParser:
    """The part's own parser, named as it is run: ``fleetbatch <name>``."""
    module = importlib.import_module(PARTS[name][0])
    return module.build_parser(prog=f"fleetbatch {name}")


def full_parser() -> argparse.ArgumentParser:
    """The whole tree in one parser (every part imported): for completion scripts and the tests that walk it."""
    p = argparse.ArgumentParser(prog="fleetbatch", description=top_parser().description)
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    p.add_argument("--log-format", choices=("text", "json"), help="log lines as text or JSON")
    sub = p.add_subparsers(dest="part", required=True)
    for name, (_, text) in PARTS.items():
        part = part_parser(name)
        sub.add_parser(name, help=text, description=part.description, parents=[part], add_help=False)
    comp = sub.add_parser("completion", help="print a shell completion script")
    comp.add_argument("shell", choices=("bash", "zsh", "tcsh"))
    return p


def _completion(args: Sequence[str]) -> int:
    if len(args) != 1 or args[0] not in ("bash", "zsh", "tcsh"):
        print("usage: fleetbatch completion {bash,zsh,tcsh}", file=sys.stderr)
        return 2
    import shtab

    print(shtab.complete(full_parser(), shell=args[0]))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = top_parser().parse_args(argv)
    if args.verbose:
        os.environ[VERBOSE_ENV] = "1"
    if args.log_format:
        os.environ[LOG_FORMAT_ENV] = args.log_format
    if args.part == "completion":
        return _completion(args.args)
    module = importlib.import_module(PARTS[args.part][0])
    return module.main(list(args.args), prog=f"fleetbatch {args.part}")


if __name__ == "__main__":
    sys.exit(main())
