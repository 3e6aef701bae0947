"""``fleetbatch gateway up``: the one-command local deployment.

Starts an embedded Redis, one ``fleetbatch engine serve`` process per cluster (by default the planned
fleet of :mod:`gateway.deploy.fleet_up`: three clusters of catalog GPUs emulated on this CPU, each
running its plan's pipeline stages; ``--num-clusters N``: one-process engines slowed 1x, 2x
and 4x) and the gateway in this process. It writes ``<run-dir>/gateway.json`` (address, Redis URL, admin and client token
files, engine pids, the OpenAI-compatible HTTP front's URL and key file) once everything is up, and
stops everything cleanly on Ctrl-C / SIGTERM. Secrets stay off command lines and out of
world-readable files: the token files and ``gateway.json`` are 0600, the engines get the Redis URL
in their environment, and the printed URL has its password masked. An engine that dies is restarted (:mod:`gateway.deploy.supervisor`); a SIGKILL of ``fleetbatch gateway up``
leaves no engine or Redis process behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import signal
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from redis.exceptions import RedisError

from clusterfile import ENDPOINT_BACKEND, Cluster, load_cluster_file
from gateway.config import HTTP_KEY_ENV, ClusterSpec, GatewayConfig
from gateway.deploy.fleet_up import FleetSettings, describe_layout, fleet_specs, plan_fleet
from gateway.deploy.forked import EngineProcess
from gateway.deploy.supervisor import EngineSupervisor
from gateway.grpc_api.auth import CLIENT_TOKEN_ENV
from gateway.http_api.format import DEFAULT_TEMPLATE_NAME
from gateway.server import serve
from workqueue import WorkQueue, connect
from workqueue.embedded import URL_ENV, EmbeddedRedis, redact_url

log = logging.getLogger(__name__)

#: The quick unplanned fleet (``--num-clusters``): three clusters, the second twice and the third four
#: times slower than the first (capacity hints in the same ratio), like an A100, a V100 and a T4 pool.
DEFAULT_FLEET = (("fast", 0.0, 400.0), ("medium", 1.0, 200.0), ("slow", 3.0, 100.0))


def default_clusters(n: int, backend: str, size: str, served_model: str | None = None) -> list[ClusterSpec]:
    """The quick unplanned fleet: ``n`` one-process engines of a random model of ``size``, or of
    ``served_model`` (a local Hugging Face directory) when it is given."""
    model = ["--served-model", served_model] if served_model else ["--size", size]
    specs = []
    for i in range(n):
        name, slowdown, hint = DEFAULT_FLEET[i % len(DEFAULT_FLEET)]
        if i >= len(DEFAULT_FLEET):
            name = f"{name}{i // len(DEFAULT_FLEET) + 1}"
        specs.append(
            ClusterSpec(
                name=name,
                capacity_tps=hint,
                backend=backend,
                engine_args=[*model, "--slowdown", str(slowdown)],
            )
        )
    return specs


def cluster_specs(args, run_dir: Path) -> tuple[list[ClusterSpec], dict[str, dict]]:
    """The clusters to start: with ``--num-clusters`` the quick unplanned fleet; else ``--clusters``'s
    (``default``: the default fleet), planned when they name devices (with the layout each runs, logged),
    else started as the file says."""
    if args.num_clusters is not None:
        if args.clusters != "default":
            raise ValueError("--num-clusters starts the quick unplanned fleet; leave out --clusters")
        if args.num_clusters < 1:
            raise ValueError(f"--num-clusters must be >= 1, not {args.num_clusters}")
        return default_clusters(args.num_clusters, args.backend, args.size or "nano", args.served_model), {}
    given: dict[str, ClusterSpec] = {}  # the file's clusters, whose prices and markets the planned specs keep
    if args.clusters != "default":
        doc = load_cluster_file(args.clusters)
        if not doc.planned:
            return list(doc.clusters), {}
        given = {c.name: c for c in doc.clusters}
        unplanned = [c.name for c in doc.clusters if not c.devices]
        if unplanned:
            raise ValueError(
                f"{args.clusters}: clusters {unplanned} name no devices; a planned fleet needs devices for each"
            )
    if args.backend != "native":
        raise ValueError(
            f"a planned fleet runs native engines (pipeline stages), not --backend {args.backend}"
        )
    settings = FleetSettings.from_args(args)
    summary = plan_fleet(settings, run_dir)
    specs, layouts = fleet_specs(settings, summary)
    devices = summary["fleet"]["clusters"]
    for name, row in layouts.items():
        row["fleet_devices"] = devices[name]
        log.info("plan of %s", describe_layout(name, row, devices[name]))
    return [priced(s, given.get(s.name), devices.get(s.name, [])) for s in specs], layouts


def priced(spec: ClusterSpec, given: ClusterSpec | None, devices: list[str]) -> ClusterSpec:
    """A planned cluster's spec with the price and market of the cluster it plans (its devices' catalog price on
    demand for the default fleet), so that the cost policy and the status see them (gateway.assign.cost)."""
    market = given.market if given is not None else "on-demand"
    price = given.hourly_price() if given is not None else Cluster("x", devices=devices).hourly_price()
    return spec.model_copy(update={"price_per_hour": price, "market": market})


async def wait_for_engines(
    queue: WorkQueue, names: list[str], procs: Mapping[str, EngineProcess], timeout_s: float
) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        infos = await asyncio.to_thread(queue.clusters, names)
        if all(i.alive for i in infos):
            return
        for n, p in procs.items():
            if p.poll() is not None:
                raise RuntimeError(f"engine {n} exited with code {p.returncode}; see its log")
        if time.monotonic() > deadline:
            missing = [i.name for i in infos if not i.alive]
            raise TimeoutError(f"engines {missing} sent no heartbeat within {timeout_s:.0f} s")
        await asyncio.sleep(0.2)


def gateway_config(
    args, redis_url: str, admin_token: str, specs: list[ClusterSpec], client_token: str = ""
) -> GatewayConfig:
    """The gateway's settings; the length predictor is the learned model shipped with the project
    unless ``--predictor`` names a model directory or ``heuristic``. ``client_token`` is the token
    of the client ``local`` (none: the batch API needs no token)."""
    tokens = {client_token: "local"} if client_token else {}
    config = GatewayConfig.from_args(
        args, redis_url=redis_url, admin_token=admin_token, clusters=specs, client_tokens=tokens
    )
    if not config.tokenizer_dir and not config.chat_template and all(own_model(s) for s in specs):
        config.chat_template = (
            DEFAULT_TEMPLATE_NAME  # their tokenizer is the gateway's default, their template too
        )
        log.info("the engines run the project's own random models: chat rows take the documented template")
    return config


def own_model(spec: ClusterSpec) -> bool:
    """Whether ``spec``'s engine runs one of the project's random models (no served model, no endpoints)."""
    return (
        spec.backend != ENDPOINT_BACKEND
        and not spec.served_model
        and "--served-model" not in spec.engine_args
    )


def client_token_file(args, run_dir: Path) -> Path | None:
    """The batch API's token of ``fleetbatch gateway up`` (``$FLEETBATCH_TOKEN`` or a new one), written 0600 to
    ``<run-dir>/client-token``; None with ``--no-auth``."""
    path = run_dir / "client-token"
    if getattr(args, "no_auth", False):
        path.unlink(missing_ok=True)
        return None
    write_private(path, (os.environ.get(CLIENT_TOKEN_ENV) or secrets.token_urlsafe(24)) + "\n")
    return path


def http_settings(args, run_dir: Path) -> Path | None:
    """The HTTP front of ``fleetbatch gateway up`` (on unless ``--http-port`` < 0): its files under the run
    dir unless ``--files``, its key from ``--http-api-key`` / the environment or a new one, kept
    in ``<run-dir>/http-api-key``; returns that file (None when the front is off)."""
    if getattr(args, "http_port", None) is None or args.http_port < 0:
        args.http_port = None
        return None
    args.files = getattr(args, "files", None) or str(run_dir / "files")
    args.http_api_key = (
        getattr(args, "http_api_key", None) or os.environ.get(HTTP_KEY_ENV) or secrets.token_urlsafe(18)
    )
    key_file = run_dir / "http-api-key"
    write_private(key_file, args.http_api_key + "\n")
    return key_file


def active_cluster(queue: WorkQueue) -> Callable[[str], bool]:
    """Whether a cluster is ``active`` (an engine of it that stopped by itself, after a preemption notice, is then
    started again by the supervisor); a Redis that does not answer says no, and the supervisor asks again at its
    next check."""

    def active(name: str) -> bool:
        try:
            return queue.cluster_state(name) == "active"
        except RedisError:
            return False

    return active


def write_private(path: Path, text: str) -> None:
    """Write a file readable by its owner only from the first byte, atomically: a new file created
    0o600 by ``os.open`` (never world-readable in between), then renamed over ``path``, so a reader
    sees the old text or the new, never a torn one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        os.fchmod(fd, 0o600)  # O_CREAT's mode applies to a new file only
        f.write(text)
    os.replace(tmp, path)


def banner(info: Mapping[str, Any]) -> str:
    """What ``fleetbatch gateway up`` prints once everything is up (from ``gateway.json``'s ``info``): where
    things are, never a secret (the Redis URL's password is masked, tokens are named by their file)."""
    lines = [
        f"gateway listening on {info['address']}",
        f"  Redis: {redact_url(info['redis_url'])}",
        f"  clusters: {', '.join(info['clusters'])} (logs in {info['logs']})",
        f"  admin token: {info['admin_token_file']}",
        f"  client token: {info['client_token_file']} (sent as 'authorization: Bearer <token>')"
        if info.get("client_token_file")
        else "  client token: none (--no-auth: anyone who reaches the port may use the batch API)",
    ]
    if info.get("http_url"):
        lines.append(f"  OpenAI-compatible API: {info['http_url']} (key: {info['http_api_key_file']})")
        page = info["status_url"]
        lines.append(f"  Status page: {page} (asks for that key; or open {page}#key=<the key>)")
    lines.append("  Ctrl-C stops everything")
    return "\n".join(lines)


async def up(args) -> int:
    run_dir = Path(args.run_dir).resolve()
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    specs, layouts = await asyncio.to_thread(cluster_specs, args, run_dir)
    token = os.environ.get("FLEETBATCH_ADMIN_TOKEN") or secrets.token_urlsafe(18)
    token_file = run_dir / "admin-token"
    write_private(token_file, token + "\n")
    http_key_file = http_settings(args, run_dir)
    client_file = client_token_file(args, run_dir)
    redis_server = None
    url = args.redis_url or os.environ.get(URL_ENV)
    if not url:
        redis_server = EmbeddedRedis(run_dir / "redis")
        url = redis_server.url
    stop = asyncio.Event()
    engines: EngineSupervisor | None = None
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        queue = WorkQueue(connect(url))
        engines = EngineSupervisor(
            specs,
            url,
            run_dir / "logs",
            threads=args.engine_threads,
            extra=args.engine_arg or [],
            max_restarts=getattr(args, "engine_restarts", 5),
            wanted=active_cluster(queue),
        )
        engines.start_all()
        client_token = client_file.read_text().strip() if client_file else ""
        config = gateway_config(args, url, token, specs, client_token)
        ready = asyncio.Event()
        gateway = asyncio.create_task(serve(config, ready=ready, stop=stop))
        ready_wait = asyncio.create_task(ready.wait())
        await asyncio.wait([gateway, ready_wait], return_when=asyncio.FIRST_COMPLETED)
        if gateway.done():
            gateway.result()  # raises the startup error
        await wait_for_engines(queue, [s.name for s in specs], engines.procs, args.engine_timeout)
        info = {
            "address": config.bound_address,
            "redis_url": url,
            "admin_token_file": str(token_file),
            "client_token_file": str(client_file) if client_file else None,
            "clusters": [s.name for s in specs],
            "engine_pids": engines.pids,
            "pid": os.getpid(),
            "redis_pid": redis_server.pid if redis_server is not None else None,
            "logs": str(run_dir / "logs"),
            "layouts": layouts,
        }
        if config.http_url:
            page = config.http_url.removesuffix("/v1") + "/status"
            info.update(http_url=config.http_url, http_api_key_file=str(http_key_file), status_url=page)
        info_file = run_dir / "gateway.json"
        write_private(info_file, json.dumps(info, indent=2))  # it holds the Redis URL
        engines.on_change = lambda pids: write_private(
            info_file, json.dumps({**info, "engine_pids": pids}, indent=2)
        )
        print(banner(info), flush=True)
        watcher = asyncio.create_task(engines.watch(stop))
        await gateway
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        return 0
    finally:
        stop.set()
        if engines is not None:
            await asyncio.to_thread(engines.stop)
        with contextlib.suppress(FileNotFoundError):
            (run_dir / "gateway.json").unlink()
        if redis_server is not None:
            redis_server.close()
        log.info("local deployment stopped")
