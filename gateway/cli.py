"""The ``gateway`` command: serve, run a local deployment, inspect and rebalance clusters."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from pathlib import Path

from cliutil import enable_config_file, run_main
from gateway.cli_options import add_common, add_http, add_rebalance
from gateway.cli_tables import batch_table, cluster_table, cost_line
from gateway.config import NAME_RE, TOKEN_ENV, GatewayConfig, load_clusters
from gateway.deploy import calibrate, prepare, redis_acl
from gateway.deploy.fleet_up import FLEET_METHODS
from gateway.grpc_api.auth import CLIENT_TOKEN_ENV, TOKENS_ENV, client_token, load_tokens
from workqueue.embedded import die_with_parent_from_env

DEFAULT_TARGET = "127.0.0.1:50051"


def build_parser(prog: str = "fleetbatch gateway") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description=(
            "The fleetbatch gateway: accepts batches over gRPC, predicts each query's response length, "
            "assigns queries to clusters by predicted tokens per unit of capacity, queues them in Redis, "
            "and moves queued work from busy clusters to idle ones."
        ),
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run the gRPC gateway against a Redis server")
    s.add_argument(
        "--listen", default="127.0.0.1:50051", help="host:port to listen on (port 0: any free port)"
    )
    s.add_argument(
        "--redis-url",
        default=None,
        help="Redis URL (default: $FLEETBATCH_REDIS_URL, else an embedded server)",
    )
    s.add_argument(
        "--clusters",
        default=None,
        metavar="FILE",
        help="the cluster file: each cluster's name, capacity or devices, backend, plan (docs/reference/cluster-file.md)",
    )
    s.add_argument(
        "--client-tokens", help=f"file of CLIENT:TOKEN lines, client tokens (default: ${TOKENS_ENV})"
    )
    s.add_argument("--no-auth", action="store_true", help="no client tokens: anyone may use the batch API")
    add_common(s)
    add_http(s, None, "off", "runs/openai-files")
    # every option also from FLEETBATCH_<OPTION> or a YAML file; FLEETBATCH_CLIENT_TOKENS is the token table itself
    enable_config_file(s, env_exempt=("client_tokens",))

    u = sub.add_parser(
        "up",
        help="local deployment: embedded Redis + engines + gateway, Ctrl-C stops all",
        description=(
            "Start an embedded Redis, one engine process per cluster and the gateway. By default the fleet "
            "is three clusters of catalog GPUs emulated on this CPU (fast: 2 x A100-40G, medium: V100-32G + "
            "T4, slow: 2 x T4), each planned at start-up by the phase-aware planner (layer split, bits per "
            "layer, micro-batches) and run as pipeline stages that last what their devices take. "
            "--clusters FILE names other clusters; --num-clusters N starts the quick unplanned fleet (one "
            "engine process per cluster, 1x, 2x and 4x slower)."
        ),
    )
    u.add_argument("--listen", default="127.0.0.1:50051", help="gateway host:port (port 0: any free port)")
    u.add_argument("--redis-url", default=None, help="use this Redis instead of an embedded one")
    u.add_argument(
        "--clusters",
        default="default",
        metavar="FILE",
        help="the cluster file (docs/reference/cluster-file.md): clusters that name devices are planned and "
        "emulated here, others start as the file says; 'default': three planned clusters of catalog GPUs",
    )
    u.add_argument(
        "--fleet-method",
        default="ilp",
        choices=FLEET_METHODS,
        help="the plan each cluster runs: ilp (the planner), uniform (even split, one bit width that fits), "
        "het (speed-balanced split, one bit width) or best-baseline (the faster of the two, modelled)",
    )
    u.add_argument(
        "--fleet-lengths",
        default="128,128",
        metavar="PROMPT,OUTPUT",
        help="mean prompt and response tokens the fleet is planned for (default 128,128)",
    )
    u.add_argument(
        "--num-clusters",
        type=int,
        default=None,
        help="start the quick unplanned fleet of N engines instead (slowed 1x, 2x, 4x, ...; no --clusters)",
    )
    u.add_argument("--backend", default="native", choices=("native", "static", "vllm"), help="engine backend")
    u.add_argument(
        "--size",
        default=None,
        help="size of the random served model (nano, micro, tiny, small, base; default micro with a planned "
        "fleet, nano with --num-clusters)",
    )
    u.add_argument("--run-dir", default="runs/local", help="Redis data, logs, admin token, gateway.json")
    u.add_argument("--engine-threads", type=int, default=1, help="torch threads per engine process")
    u.add_argument("--engine-timeout", type=float, default=300.0, help="seconds to wait for engines to start")
    u.add_argument(
        "--no-auth", action="store_true", help="no client token (default: one in RUN_DIR/client-token)"
    )
    u.add_argument(
        "--engine-arg",
        action="append",
        help="extra argument for every `fleetbatch engine serve` (repeatable)",
    )
    add_common(u)
    add_http(u, 0, "any free port", None)

    r = sub.add_parser(
        "rebalance",
        help="show pending work per cluster and the moves that equalise expected finish times (or, under "
        "--policy cost, place the queued work by its split)",
        description=(
            "Admin command. Prints each cluster's pending predicted tokens, capacity and expected finish "
            "time, and the moves (from the back of queues) that equalise expected finish times (under "
            "--policy cost: that place the queued work where the cost split puts it, cheaper clusters first "
            "within the window). Dry run by default; --apply carries the moves out. Also drains, adds, "
            "removes and preempts clusters."
        ),
    )
    add_rebalance(r, DEFAULT_TARGET)

    st = sub.add_parser(
        "status",
        help="list clusters (liveness, capacity, queue, expected finish) and, with --batch-id, batches' progress and ETA",
    )
    st.add_argument(
        "--batch-id",
        action="append",
        default=[],
        metavar="ID",
        help="also show this batch: rows and token progress, ETA against its deadline, at risk (repeatable)",
    )
    st.add_argument("--target", default=DEFAULT_TARGET, help="gateway address host:port")
    st.add_argument("--json", action="store_true", help="print JSON")
    st.add_argument("--tls-ca", default=None, help="CA certificate (PEM): connect over TLS")
    st.add_argument("--token", help=f"client token (default: ${CLIENT_TOKEN_ENV}, else --token-file)")
    st.add_argument("--token-file", default="runs/local/client-token", help="file of the client token")

    calibrate.add_arguments(
        sub.add_parser(
            "calibrate",
            help="show each served model's length calibration, or teach it from a file of the model's answers",
            description=calibrate.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    )
    prepare.add_arguments(
        sub.add_parser(
            "prepare",
            help="build the caches a fresh machine lacks (tokenizers, CPU profile, fonts); run by scripts/setup.sh",
            description=prepare.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    )
    redis_acl.add_arguments(
        sub.add_parser(
            "redis-acl",
            help="print the Redis ACL file's line for a user of a role (a cloud's engines, a gateway)",
            description=redis_acl.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    )
    return p


def _serve(args) -> int:
    from gateway.server import run
    from workqueue.embedded import redact_url, resolve_url

    clusters = load_clusters(args.clusters) if args.clusters else []
    tokens = {} if args.no_auth else load_tokens(args.client_tokens)
    if not tokens and not args.no_auth:
        raise ValueError(
            f"no client tokens: pass --client-tokens FILE or set ${TOKENS_ENV} (CLIENT:TOKEN entries), "
            "or --no-auth to serve the batch API to anyone who reaches it"
        )
    url, embedded = resolve_url(args.redis_url)
    if embedded is not None:
        print(f"no Redis URL given: started an embedded Redis at {redact_url(url)}", flush=True)
    config = GatewayConfig.from_args(
        args, redis_url=url, admin_token=args.admin_token or "", clusters=clusters, client_tokens=tokens
    )
    try:
        run(config)
    finally:
        if embedded is not None:
            embedded.close()
    return 0


def _up(args) -> int:
    import asyncio

    from gateway.deploy.up import up

    if args.admin_token:
        os.environ[TOKEN_ENV] = args.admin_token
    try:
        import uvloop

        return uvloop.run(up(args))
    except ImportError:
        return asyncio.run(up(args))


def _token(args) -> str:
    if args.token:
        return args.token
    if os.environ.get(TOKEN_ENV):
        return os.environ[TOKEN_ENV]
    path = Path(args.token_file or "runs/local/admin-token")
    if path.exists():
        return path.read_text().strip()
    raise SystemExit(
        f"fleetbatch gateway rebalance: no admin token: pass --token, set ${TOKEN_ENV} or --token-file"
    )


def _rebalance(args) -> int:
    import grpc
    from google.protobuf.json_format import MessageToDict

    from protos import fleetbatch_pb2 as pb
    from protos import fleetbatch_pb2_grpc as pb_grpc

    md = [("authorization", f"Bearer {_token(args)}")]
    from gateway.grpc_api.tls import channel

    with channel(args.target, args.tls_ca, token="") as ch:  # the admin token goes per call
        admin = pb_grpc.AdminServiceStub(ch)
        try:
            if args.add:
                return _add(admin, args, md)
            if args.preempt:
                request = pb.DrainClusterRequest(
                    name=args.preempt, dry_run=not args.apply, preempt=True, notice_s=args.notice
                )
                resp = admin.DrainCluster(request, metadata=md)
            elif args.remove:
                resp = admin.RemoveCluster(
                    pb.RemoveClusterRequest(name=args.remove, force=args.force, dry_run=not args.apply),
                    metadata=md,
                )
            else:
                resp = admin.Rebalance(
                    pb.RebalanceRequest(dry_run=not args.apply, drain=args.drain or []), metadata=md
                )
                if args.drain and args.apply:
                    for name in args.drain:
                        admin.DrainCluster(pb.DrainClusterRequest(name=name, dry_run=False), metadata=md)
        except grpc.RpcError as e:
            print(f"fleetbatch gateway rebalance: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps(MessageToDict(resp, preserving_proto_field_name=True)))
        return 0
    print(cluster_table(resp.before))
    print()
    print(resp.message)
    if resp.applied:
        print(f"applied: moved {sum(m.moved for m in resp.moves)} queries")
    else:
        print("dry run: nothing moved (pass --apply to carry it out)")
    return 0


def _add(admin, args, md) -> int:
    """``rebalance --add``: validated here first; a dry run (nothing written) unless --apply."""
    from protos import fleetbatch_pb2 as pb

    if not math.isfinite(args.capacity) or args.capacity < 0:
        print(
            f"fleetbatch gateway rebalance: --capacity must be a finite number >= 0 (0: no hint), not {args.capacity}",
            file=sys.stderr,
        )
        return 1
    if not NAME_RE.match(args.add):
        print(
            f"fleetbatch gateway rebalance: cluster name {args.add!r} must be 1-128 characters of [A-Za-z0-9_.-]",
            file=sys.stderr,
        )
        return 1
    what = "update" if args.update else "add"
    if not args.apply:
        known = {c.name for c in admin.GetClusterStatus(pb.ListClustersRequest(), metadata=md).clusters}
        if args.add in known and not args.update:
            print(
                f"fleetbatch gateway rebalance: cluster {args.add} exists; pass --update to change it",
                file=sys.stderr,
            )
            return 1
        print(
            f"dry run: would {what} cluster {args.add} (capacity {args.capacity:.1f} tokens/s); "
            "pass --apply to carry it out"
        )
        return 0
    req = pb.AddClusterRequest(name=args.add, capacity_tokens_per_s=args.capacity, update=args.update)
    resp = admin.AddCluster(req, metadata=md)
    done = "updated" if args.update else "added"
    print(f"{done} cluster {resp.name} (capacity {resp.capacity_tokens_per_s:.1f} tokens/s)")
    return 0


def _status(args) -> int:
    import grpc
    from google.protobuf.json_format import MessageToDict

    from gateway.grpc_api.tls import channel
    from protos import fleetbatch_pb2 as pb
    from protos import fleetbatch_pb2_grpc as pb_grpc

    with channel(args.target, args.tls_ca, token=client_token(args.token, args.token_file)) as ch:
        stub = pb_grpc.BatchServiceStub(ch)
        try:
            resp = stub.ListClusters(pb.ListClustersRequest(), timeout=10)
            batches = [stub.GetBatch(pb.GetBatchRequest(batch_id=b), timeout=10) for b in args.batch_id]
        except grpc.RpcError as e:
            print(f"fleetbatch gateway status: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    if args.json:
        out = MessageToDict(resp, preserving_proto_field_name=True)
        out["batches"] = [MessageToDict(b, preserving_proto_field_name=True) for b in batches]
        print(json.dumps(out))
    else:
        tables = cluster_table(resp.clusters) + "\n" + cost_line(resp)
        print(tables + ("\n\n" + batch_table(batches, time.time()) if batches else ""))
    return 0


def _calibrate(args) -> int:
    print(json.dumps(calibrate.run(args)))
    return 0


def _prepare(args) -> int:
    print(json.dumps(prepare.run(args)))
    return 0


COMMANDS = {
    "serve": _serve,
    "up": _up,
    "rebalance": _rebalance,
    "status": _status,
    "calibrate": _calibrate,
    "prepare": _prepare,
    "redis-acl": lambda args: print(redis_acl.run(args)) or 0,
}
ERRORS = (FileNotFoundError, ValueError, ConnectionError, OSError, TimeoutError, RuntimeError)


def main(argv: list[str] | None = None, prog: str = "fleetbatch gateway") -> int:
    die_with_parent_from_env()  # started by a harness that named itself: not to outlive it
    return run_main(
        build_parser(prog),
        argv,
        lambda args: COMMANDS[args.command](args),
        prog=prog,
        errors=ERRORS,
        message="{prog}{command}: {error}",
        levels=(logging.INFO, logging.DEBUG),
    )


if __name__ == "__main__":
    sys.exit(main())
