"""Build and run the gateway: grpc.aio on uvloop, health checking, reflection, offloader, metrics."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gateway.assign.calibrated import LengthCalibrator, LengthEstimates
from gateway.assign.cost import SPOT_MARGIN, fleet_prices, spot_clusters
from gateway.assign.prefixes import prefix_finder
from gateway.assign.registry import make_policy
from gateway.assign.tokens import token_bound
from gateway.batches.deps import GatewayDeps
from gateway.batches.limits import InflightBytes
from gateway.batches.service import BatchService
from gateway.config import GatewayConfig, redact_url
from gateway.grpc_api.admin import AdminService
from gateway.grpc_api.auth import AdminInterceptor, Authenticator, AuthInterceptor
from gateway.grpc_api.inflight import InflightBytesInterceptor
from gateway.grpc_api.interceptors import MalformedRequestInterceptor, RedisUnavailableInterceptor
from gateway.grpc_api.servicer import BatchServicer
from gateway.grpc_api.tls import server_credentials
from gateway.http_api.server import HttpServer  # starlette + uvicorn: ~70 ms of ~400 (python -X importtime)
from gateway.offload.offloader import OffloadConfig, Offloader
from gateway.status.cost import CostMeter
from gateway.status.eta import EtaBoard
from gateway.status.metrics import GatewayMetrics
from localmodels.prompt_ids import split_by_rule
from planfile import load_plan
from protos import fleetbatch_pb2 as pb
from protos import fleetbatch_pb2_grpc as pb_grpc
from workqueue import WorkQueue, connect
from workqueue.ordering import QueueOrder
from workqueue.upgrade import upgrade_queues

log = logging.getLogger(__name__)

COUNT_SLICE = 8192  # prompts tokenized per call when counting a large batch's tokens


def load_tokenizer(tokenizer_dir: str | None):
    """The serving model's tokenizer (a model directory), or the project's default tokenizer."""
    if tokenizer_dir:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    from localmodels import default_tokenizer

    return default_tokenizer()


def token_counter(tokenizer) -> Callable[[list[str]], list[int]]:
    """Prompt tokens as the engine counts them (the start token included, unless the prompt begins with
    it already: :mod:`localmodels.prompt_ids`), as ``tokenizer(prompts)`` counts them. A fast tokenizer
    whose backend neither truncates nor pads is asked for counts directly (``encode_batch_fast``: no
    offsets, no Python id lists), several times faster on a large batch, ``COUNT_SLICE`` prompts at a
    time; the counts are the same."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    encode = getattr(backend, "encode_batch_fast", None) or getattr(backend, "encode_batch", None)
    if encode is not None and backend.truncation is None and backend.padding is None:

        def count_part(prompts: list[str], special: bool) -> list[int]:
            out: list[int] = []
            for i in range(0, len(prompts), COUNT_SLICE):  # bounded memory: encodings are large
                out += [len(e) for e in encode(prompts[i : i + COUNT_SLICE], add_special_tokens=special)]
            return out

    else:

        def count_part(prompts: list[str], special: bool) -> list[int]:
            if not prompts:
                return []
            return [len(ids) for ids in tokenizer(prompts, add_special_tokens=special)["input_ids"]]

    def count(prompts: list[str]) -> list[int]:
        with_, without = split_by_rule(tokenizer, prompts)
        if not without:  # the common case: no prompt begins with the start token
            return count_part(prompts, True)
        out = [0] * len(prompts)
        for part, special in ((with_, True), (without, False)):
            for i, n in zip(part, count_part([prompts[i] for i in part], special), strict=True):
                out[i] = n
        return out

    return count


def build_deps(config: GatewayConfig) -> GatewayDeps:
    """Connect to Redis, register configured clusters, load tokenizer, predictor and policy."""
    from predictor.serving import LengthPredictor

    if not config.redis_url:
        raise ValueError("no Redis URL configured")
    order = QueueOrder(config.queue_order, config.priority_step_s)
    queue = WorkQueue(connect(config.redis_url), retention_s=config.retention_s, order=order)
    for name, n in upgrade_queues(queue.r, order).items():
        log.warning(
            "cluster %s: its queue of %d queries, a list of an older version, is now ordered by deadline",
            name,
            n,
        )
    for c in config.clusters:
        queue.register_cluster(
            c.name,
            capacity_hint_tps=c.capacity_tps or None,
            backend=c.backend,
            max_query_tokens=c.max_query_tokens or None,
            kv_budget_tokens=c.kv_budget_tokens or None,
            plan_tps=_plan_tps(c.plan),
        )
    tokenizer = load_tokenizer(config.tokenizer_dir)
    predictor = LengthPredictor.from_dir(config.predictor_dir, threads=config.predictor_threads)
    log.info(
        "length predictor: %s",
        "prompt-length heuristic (no model configured)" if predictor.is_fallback else predictor.version,
    )

    count_tokens = token_counter(tokenizer)

    calibrator = LengthCalibrator(queue)

    def predict_tokens(prompts: list[str]) -> LengthEstimates:
        return calibrator.estimates(
            [p.expected_tokens for p in predictor.predict(prompts)] if prompts else []
        )

    policy = make_policy(
        config.policy, fleet_prices(config.clusters), spot_clusters(config.clusters), config.spot_margin
    )
    deps = GatewayDeps(
        config=config,
        queue=queue,
        count_tokens=count_tokens,
        predict_tokens=predict_tokens,
        calibrator=calibrator,
        policy=policy,
        metrics=GatewayMetrics(config.metrics_batches),
        eta=EtaBoard(
            cost=CostMeter(fleet_prices(config.clusters)), balanced=not getattr(policy, "priced", False)
        ),
        predictor=predictor,
        token_bound=token_bound(tokenizer),
        tokenizer=tokenizer,
        inflight=InflightBytes(config.max_inflight_bytes) if config.max_inflight_bytes > 0 else None,
        # prefix groups are looked for only for a policy that keeps them together (gateway.assign.prefix_policy)
        find_prefixes=prefix_finder(tokenizer) if getattr(policy, "uses_prefixes", False) else None,
    )
    return deps


def _plan_tps(path: str | None) -> float | None:
    if not path:
        return None
    try:
        return load_plan(path).predicted_throughput_tokens_per_s
    except (FileNotFoundError, ValueError) as e:
        log.warning("plan %s not readable here (%s); using the capacity hint", path, e)
        return None


async def serve(
    config: GatewayConfig, ready: asyncio.Event | None = None, stop: asyncio.Event | None = None
) -> None:
    deps = await asyncio.to_thread(build_deps, config)
    auth = Authenticator(config.client_tokens, config.token() if config.client_tokens else "")
    server = grpc.aio.server(
        interceptors=_interceptors(deps, config, auth),  # the first is the outermost
        options=[("grpc.max_receive_message_length", config.max_request_bytes)],
        maximum_concurrent_rpcs=config.max_concurrent_rpcs or None,
    )
    batches = BatchService(deps)
    pb_grpc.add_BatchServiceServicer_to_server(BatchServicer(batches, auth), server)
    pb_grpc.add_AdminServiceServicer_to_server(AdminService(deps), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    services = [
        pb.DESCRIPTOR.services_by_name["BatchService"].full_name,
        pb.DESCRIPTOR.services_by_name["AdminService"].full_name,
        health.SERVICE_NAME,
        reflection.SERVICE_NAME,
    ]
    reflection.enable_server_reflection(services, server)
    if config.tls_cert or config.tls_key:
        port = server.add_secure_port(config.listen, server_credentials(config.tls_cert, config.tls_key))
    else:
        port = server.add_insecure_port(config.listen)
    if port == 0:
        raise OSError(f"cannot listen on {config.listen}")
    if auth.enabled and not config.tls_cert and not _loopback(config.listen):
        log.warning(
            "client tokens travel in plaintext to %s: serve TLS (--tls-cert/--tls-key)", config.listen
        )
    await server.start()
    for name in services[:2]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    if config.metrics_port:
        deps.metrics.serve(config.metrics_port, config.metrics_host, config.token())
        log.info("Prometheus metrics on http://%s:%d/metrics", config.metrics_host, config.metrics_port)
    host = config.listen.rsplit(":", 1)[0]
    config.bound_address = f"{host}:{port}"
    log.info(
        "gateway listening on %s%s (%s, policy %s, Redis %s, positions %d, request limit %d bytes)",
        config.bound_address,
        " with TLS" if config.tls_cert else "",
        "client tokens required" if auth.enabled else "NO client authentication",
        config.policy,
        redact_url(config.redis_url),
        config.model_positions(),
        config.max_request_bytes,
    )
    http = None
    if config.http_port is not None:  # the OpenAI-compatible front, same process and loop
        http = HttpServer(batches, config)
        try:
            config.http_url = await http.start()
        except BaseException:
            await http.stop()
            await server.stop(grace=None)
            raise
    stop = stop or asyncio.Event()
    tasks = []
    # lease recovery and evacuation always run; --no-offload turns off only moves between live clusters
    offloader = Offloader(
        deps.queue,
        OffloadConfig(  # the cost policy's prices and spot clusters
            balance=config.offload,
            prices=getattr(deps.policy, "prices", None),
            spot=getattr(deps.policy, "spot", frozenset()),
            spot_margin=getattr(deps.policy, "spot_margin", SPOT_MARGIN),
        ),
        metrics=deps.metrics,
        eta=deps.eta,
        calibrator=deps.calibrator,
    )
    tasks.append(asyncio.create_task(_offload_loop(offloader, config, stop)))
    tasks.append(asyncio.create_task(_reload_loop(deps, stop)))
    tasks.append(asyncio.create_task(batches.intake.loop(stop)))  # large batches, accepted, enqueue here
    if ready is not None:
        ready.set()
    await stop.wait()
    log.info("gateway stopping")
    await health_servicer.enter_graceful_shutdown()
    if http is not None:
        await http.stop()
    await server.stop(grace=2)
    for t in tasks:
        t.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await t


def _loopback(listen: str) -> bool:
    host = listen.rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


def _interceptors(
    deps: GatewayDeps, config: GatewayConfig, auth: Authenticator
) -> list[grpc.aio.ServerInterceptor]:
    """Tokens first (the admin token on the admin API, client tokens on the batch API: a refused
    call is not decoded), then the in-flight bytes, then errors."""
    services = pb.DESCRIPTOR.services_by_name
    chain: list[grpc.aio.ServerInterceptor] = [
        AdminInterceptor(config.token, services["AdminService"].full_name)
    ]
    if auth.enabled:
        chain.append(AuthInterceptor(auth, services["BatchService"].full_name))
    if deps.inflight is not None:
        chain.append(InflightBytesInterceptor(deps.inflight, pb.DESCRIPTOR.package))
    chain += [RedisUnavailableInterceptor(pb.DESCRIPTOR.package), MalformedRequestInterceptor(pb.DESCRIPTOR)]
    return chain


async def _offload_loop(offloader: Offloader, config: GatewayConfig, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            await asyncio.to_thread(offloader.tick)
        except Exception:
            log.exception("offloader tick failed")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=config.offload_interval_s)


async def _reload_loop(deps: GatewayDeps, stop: asyncio.Event, every_s: float = 30.0) -> None:
    """Hot reload: pick up a newer predictor version written into the configured directory."""
    predictor = deps.predictor
    if predictor is None or predictor.is_fallback:
        return
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=every_s)
        if stop.is_set():
            return
        before = predictor.version
        try:
            after = await asyncio.to_thread(predictor.reload)
        except Exception as e:
            log.warning("predictor reload failed, keeping %s: %s", before, e)
            continue
        if after != before:
            log.info("predictor reloaded: %s -> %s", before, after)


def run(config: GatewayConfig) -> None:
    """Run until SIGINT/SIGTERM, on uvloop where available."""
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await serve(config, stop=stop)

    runner(main())
