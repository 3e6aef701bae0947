"""The ``engine`` command: run one cluster's engine (``serve``), offline generation and benchmarks."""

from __future__ import annotations

import argparse
import logging
import sys

from engines import worker


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="engine",
        description=(
            "Per-cluster inference engine. `serve` pulls queries from the cluster's Redis queue and "
            "generates them with iteration-level batching; `generate` runs a JSONL file offline; "
            "`bench` compares the engine with static and Hugging Face continuous batching."
        ),
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve",
        help="serve one cluster: consume its Redis queue, generate, write results",
        description="Serve one cluster: take queries from its Redis queue, generate, write results once per query.",
    )
    worker.add_serve_arguments(serve)
    for name in ("generate", "bench"):
        sub.add_parser(name, help=f"{name} (not built yet: issue [4/9])")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.command == "serve":
        return worker.run_serve(args)
    print(f"engine {args.command}: not built yet (issue [4/9])", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
