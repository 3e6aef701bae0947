"""``fleetbatch loadgen prefix``: a batch whose rows share long prefixes, token-only against prefix-aware assignment.

The workload (:func:`fleetdata.prefixes.shared_prefix_rows`, real data): ``--groups`` few-shot blocks
of gsm8k worked examples (``--prefix-words``: about 200-800 tokens each), each in front of many real
questions, plus ``--unique-share`` of rows with no shared prefix; rows shuffled, as a batch file
written without care; every row generates its question's recorded answer length (capped at
``--max-tokens``).

The fleet: ``fleetbatch loadgen study``'s three unlike clusters (cost-model devices at speeds 1, 1/2, 1/4 of
``--step-cost``; real engines, the small random model, embedded Redis, ``fleetbatch gateway up``), each engine
with a modest KV cache (``--kv-budget-tokens``) so that rows of many groups mixed in one queue evict each
other's prefixes. Setups (``--setups``), one ``fleetbatch gateway up`` each, the same batch:

* ``token``: ``--policy token``, the engines' prefix cache on (a group's rows spread over every cluster);
* ``prefix``: ``--policy prefix`` (:mod:`gateway.assign.prefix_policy`), the cache on;
* ``token_nocache``: ``--policy token``, every engine ``--no-prefix-cache``.

Each run is a run directory (``fleetbatch loadgen report`` reads it) with ``prefixes.json``: each row's prefix
group and shared tokens as the gateway's rule finds them (:mod:`gateway.assign.prefixes`), which the
simulator's replay (``python -m sim.cli validate``) gives its engines. The last line is one JSON
object (:mod:`load.studies.prefix_stats`): ``prefix_aware_over_token`` (token's makespan over prefix's),
``hit_rate`` (the prefix run's, from the engines' heartbeats: hit / looked-up prompt tokens),
``sim_makespan_error`` (mean |sim - measured| / measured over the runs), and per setup its makespan,
hit rate and simulated makespan.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from clusterfile import dump_cluster_file
from gateway.assign.prefixes import prefix_finder
from gateway.grpc_api.auth import deployment_token
from gateway.grpc_api.tls import channel
from load.client import result_row, to_request
from load.deployment import LocalDeployment
from load.reports.runrecord import Sampler, write_run
from load.studies.prefix_stats import SETUPS, summarise
from load.studies.study import Setup, add_fleet_arguments, fleet_yaml, sim_cli
from load.workload import WorkItem
from protos import fleetbatch_pb2 as pb
from protos import fleetbatch_pb2_grpc as pb_grpc
from workqueue import WorkQueue, connect, keys

SPEEDS = (1.0, 2.0, 4.0)


def add_arguments(p) -> None:
    p.add_argument("--num-queries", "-n", type=int, default=360, help="rows of the batch")
    p.add_argument("--groups", type=int, default=24, help="few-shot blocks (prefix groups)")
    p.add_argument("--unique-share", type=float, default=0.15, help="share of rows with no shared prefix")
    p.add_argument(
        "--prefix-words", default="120,480", help="words of a few-shot block, lo,hi (~200-800 tokens)"
    )
    p.add_argument(
        "--unique",
        action="store_true",
        help="the same questions with no shared prefix at all (fleetdata.prefixes.unique_rows): "
        "what prefix-aware assignment and the cache cost where nothing is shared",
    )
    p.add_argument("--max-tokens", type=int, default=128, help="cap on the recorded answer lengths")
    p.add_argument("--kv-budget-tokens", type=int, default=4096, help="each engine's KV cache, tokens")
    p.add_argument("--setups", default="token,prefix", help=f"comma-separated, of {', '.join(SETUPS)}")
    p.add_argument("--no-offload", action="store_true", help="run the gateways without the offloader")
    add_fleet_arguments(
        p, "runs/prefix", "one run directory per setup", "engine batch size (max running queries)"
    )
    p.set_defaults(emulation="cost")  # what load.studies.study.fleet_yaml reads


def workload(args) -> tuple[list[WorkItem], dict[str, list]]:
    """The batch, and each row's ``[group, shared tokens]`` by query id as the gateway's rule finds them."""
    from fleetdata.datasets import response_lengths
    from fleetdata.prefixes import shared_prefix_rows, unique_rows
    from localmodels import default_tokenizer

    lo, hi = (int(x) for x in args.prefix_words.split(","))
    rows = shared_prefix_rows(args.num_queries, args.groups, args.unique_share, (lo, hi), args.seed)
    rows = unique_rows(rows) if args.unique else rows
    tok = default_tokenizer()
    lengths = response_lengths(rows, tok)
    items = [
        WorkItem(
            id=f"prefix-{i:06d}",
            prompt=r.prompt,
            max_tokens=args.max_tokens,
            forced_length=max(1, min(args.max_tokens, n)),
            metadata={"source": r.source, "group": "" if r.meta["group"] is None else str(r.meta["group"])},
            true_length=n,
        )
        for i, (r, n) in enumerate(zip(rows, lengths, strict=True))
    ]
    prompts = [it.prompt for it in items]
    counts = [len(ids) for ids in tok(prompts, add_special_tokens=True)["input_ids"]]
    found = prefix_finder(tok)(prompts, counts)
    number: dict[str, int] = {}
    prefixes = {
        it.id: [None, 0] if g is None else [number.setdefault(g, len(number)), shared]
        for it, (g, shared) in zip(items, found, strict=True)
    }
    return items, prefixes


def fleet(name: str, args) -> dict:
    """``fleetbatch loadgen study``'s 1:2:4 cost-model fleet, each engine with ``--kv-budget-tokens`` (and no cache for ``*_nocache``)."""
    policy = SETUPS[name][0]
    out = fleet_yaml(Setup(name, policy, "native", SPEEDS), args)
    for c in out["clusters"]:
        c["engine_args"] += ["--kv-budget-tokens", str(args.kv_budget_tokens)]
        c["engine_args"] += [] if SETUPS[name][1] else ["--no-prefix-cache"]
    return out


def heartbeats(redis_url: str) -> dict[str, dict]:
    """Each cluster's last heartbeat (its engine's cumulative prefix-cache figures among them)."""
    q = WorkQueue(connect(redis_url))
    return {n: q.r.hgetall(keys.heartbeat(n)) for n in q.cluster_names()}


def run_one(name: str, items: list[WorkItem], prefixes: dict, run_dir: Path, args) -> dict:
    run_dir.mkdir(parents=True, exist_ok=True)
    dump_cluster_file(run_dir / "clusters.yaml", fleet(name, args)["clusters"])
    (run_dir / "prefixes.json").write_text(json.dumps(prefixes))
    policy = SETUPS[name][0]
    up = ["--clusters", str(run_dir / "clusters.yaml"), "--policy", policy, *args.gateway_arg]
    up += ["--no-offload"] if args.no_offload else []
    with (
        LocalDeployment(run_dir / "deploy", up) as info,
        channel(info["address"], token=deployment_token(info)) as ch,
    ):
        stub = pb_grpc.BatchServiceStub(ch)
        with Sampler(info["redis_url"], run_dir, interval_s=0.5):
            batch_id = stub.SubmitBatch(to_request(items, f"prefix-{name}"), timeout=600).id
            req = pb.StreamResultsRequest(batch_id=batch_id, follow=True)
            rows = [result_row(r) for r in stub.StreamResults(req, timeout=3600)]
            time.sleep(2.5)  # the engines' last heartbeats carry their final figures
            beats = heartbeats(info["redis_url"])
    meta = {
        "batch_id": batch_id,
        "policy": policy,
        "backend": "native",
        "fleet": list(SPEEDS),
        "emulation": "cost",
        "offload": not args.no_offload,
        "device_cost_ms": args.step_cost,
        "prefix_cache": SETUPS[name][1],
        "heartbeats": beats,
    }
    write_run(run_dir, rows, meta)
    return {"rows": rows, "heartbeats": beats, "dir": str(run_dir)}


def run(args) -> dict:
    chosen = [s for s in args.setups.split(",") if s]
    unknown = [s for s in chosen if s not in SETUPS]
    if unknown or not chosen:
        raise ValueError(f"--setups: unknown {unknown or 'none given'}; choose from {', '.join(SETUPS)}")
    items, prefixes = workload(args)
    root = Path(args.out)
    runs = {name: run_one(name, items, prefixes, root / name, args) for name in chosen}
    replay = sim_cli("validate", *(r["dir"] for r in runs.values()))
    out = summarise(runs, replay, items, prefixes)
    out.update(
        queries=len(items),
        groups=args.groups,
        unique_share=args.unique_share,
        prefix_words=args.prefix_words,
        max_tokens=args.max_tokens,
        kv_budget_tokens=args.kv_budget_tokens,
        batch=args.max_running,
        step_cost_ms=args.step_cost,
        offload=not args.no_offload,
        out=str(root),
    )
    return out
