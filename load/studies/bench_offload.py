"""Benchmark: one batch on a fleet with a slow cluster, with and without backoff offloading.

Both runs use the same workload, the same fleet (every cluster *configured* with the same
capacity hint, one of them secretly ``--slowdown`` times slower, like a GPU pool that turns
out slower than its spec) and the same assignment policy; only offloading differs. Each
run starts its own ``fleetbatch gateway up`` deployment. The last printed line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from clusterfile import dump_cluster_file
from gateway.grpc_api.auth import deployment_token
from load.client import run_batch, summarise
from load.deployment import LocalDeployment
from load.workload import from_dataset


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", "--num-queries", type=int, default=150, help="queries in the batch")
    p.add_argument(
        "--dataset", default="mixed", help="dataset of ../shared/data for prompts and recorded lengths"
    )
    p.add_argument("--max-tokens", type=int, default=128, help="cap on the forced response length")
    p.add_argument(
        "--slowdown", type=float, default=4.0, help="the slow cluster sleeps this multiple of each step"
    )
    p.add_argument("--num-clusters", type=int, default=3, help="clusters in the fleet (the last one is slow)")
    p.add_argument("--backend", default="native", choices=("native", "static"), help="engine backend")
    p.add_argument("--size", default="tiny", help="random model size")
    p.add_argument("--policy", default="token", help="assignment policy of both runs")
    p.add_argument("--seed", type=int, default=0, help="workload sampling seed")
    p.add_argument("--timeout", type=float, default=900, help="seconds per run")


def _fleet(args, run_dir: Path) -> Path:
    clusters = []
    for i in range(args.num_clusters):
        slow = i == args.num_clusters - 1
        clusters.append(
            {
                "name": f"c{i}" + ("-slow" if slow else ""),
                "capacity_tps": 100.0,
                "backend": args.backend,
                "engine_args": ["--size", args.size, "--slowdown", str(args.slowdown if slow else 0.0)],
            }
        )
    path = run_dir / "clusters.yaml"
    dump_cluster_file(path, clusters)
    return path


def _one_run(args, items, offload: bool) -> dict:
    with tempfile.TemporaryDirectory(prefix="fleetbatch-bench-") as tmp:
        run_dir = Path(tmp)
        up_args = ["--clusters", str(_fleet(args, run_dir)), "--policy", args.policy]
        with LocalDeployment(run_dir, up_args + ([] if offload else ["--no-offload"]), args.timeout) as info:
            batch, results, wall = run_batch(
                info["address"], items, progress=True, timeout_s=args.timeout, token=deployment_token(info)
            )
            return summarise(batch, results, wall)


def run(args) -> dict:
    from localmodels import default_tokenizer  # lazy: transformers (loadgen starts without)

    items = from_dataset(
        args.dataset, args.num_queries, args.seed, args.max_tokens, True, default_tokenizer()
    )
    without = _one_run(args, items, offload=False)
    with_ = _one_run(args, items, offload=True)
    return {
        "queries": len(items),
        "slowdown": args.slowdown,
        "backend": args.backend,
        "wall_s_without_offload": without["wall_s"],
        "wall_s_with_offload": with_["wall_s"],
        "speedup_with_offload": round(without["wall_s"] / with_["wall_s"], 3) if with_["wall_s"] else None,
        "per_cluster_without": {k: v["queries"] for k, v in without["clusters"].items()},
        "per_cluster_with": {k: v["queries"] for k, v in with_["clusters"].items()},
        "all_results_once": without["duplicates"] == 0
        and with_["duplicates"] == 0
        and without["results"] == with_["results"] == len(items),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m load.studies.bench_offload", description=__doc__)
    add_arguments(parser)
    print(json.dumps(run(parser.parse_args())))
