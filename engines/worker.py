"""The Redis worker of one cluster: queue -> engine -> results, with leases and heartbeats.

The loop takes only as many queries as the engine can admit soon (``free_slots``), so
work that has not started stays in Redis where an idle cluster can take it. A background
thread renews the leases of in-flight queries and publishes the cluster heartbeat
(running, waiting, KV used/free, measured tokens/s), so a long engine step never lets a
lease lapse, while a dead worker's leases do lapse and its queries are requeued.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import threading
import time
import uuid
from dataclasses import dataclass

from engines.interface import Engine, Request, RequestOutput, SamplingParams
from engines.metrics import serve_metrics
from engines.pipeline import StageFailure
from workqueue import ClaimedQuery, WorkQueue, connect
from workqueue.embedded import URL_ENV

log = logging.getLogger(__name__)


@dataclass
class WorkerConfig:
    cluster: str
    lease_s: float = 15.0
    heartbeat_s: float = 1.0
    heartbeat_ttl_s: float = 5.0
    idle_poll_s: float = 0.05
    idle_poll_max_s: float = 0.5
    cancel_check_s: float = 0.5
    requeue_check_s: float = 2.0
    backend: str = "static"
    capacity_hint_tps: float = 0.0
    plan_tps: float = 0.0
    max_query_tokens: int = 0
    slowdown: float = 0.0  # extra sleep per step, as a multiple of the step's time (mimics a slower GPU)
    record_observed: bool = True


class Worker:
    """Drives one :class:`~engines.interface.Engine` from one cluster's queue."""

    def __init__(self, queue: WorkQueue, engine: Engine, config: WorkerConfig):
        self.queue = queue
        self.engine = engine
        self.config = config
        self.worker_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.inflight: dict[str, ClaimedQuery] = {}
        self._lock = threading.Lock()
        self.stop_event = threading.Event()
        self.finished = 0
        self.removed = False  # the cluster was removed by `gateway rebalance --remove`: claim nothing
        self.failure: str | None = None  # why the engine stopped, when it failed

    # ------------------------------------------------------------------ main loop

    def run(self, max_queries: int | None = None) -> int:
        """Serve until stopped (or until ``max_queries`` have finished); returns how many finished."""
        c = self.config
        self.queue.register_cluster(
            c.cluster,
            backend=c.backend,
            capacity_hint_tps=c.capacity_hint_tps or None,
            plan_tps=c.plan_tps or None,
            max_query_tokens=c.max_query_tokens or None,
        )
        keeper = threading.Thread(target=self._keep_alive, name="lease-keeper", daemon=True)
        keeper.start()
        log.info("worker %s serving cluster %r with the %s backend", self.worker_id, c.cluster, c.backend)
        idle_sleep = c.idle_poll_s
        last_cancel = last_requeue = 0.0
        try:
            while not self.stop_event.is_set():
                now = time.monotonic()
                if now - last_requeue > c.requeue_check_s:
                    n = self.queue.requeue_expired(c.cluster)
                    if n:
                        log.warning("requeued %d queries whose worker stopped renewing its lease", n)
                    last_requeue = now
                if now - last_cancel > c.cancel_check_s:
                    self._check_cancelled()
                    self._check_removed()
                    last_cancel = now
                if not self.removed:
                    self._admit()
                if not self.engine.has_unfinished():
                    self.stop_event.wait(idle_sleep)
                    idle_sleep = min(c.idle_poll_max_s, idle_sleep * 2)
                    continue
                idle_sleep = c.idle_poll_s
                t0 = time.monotonic()
                try:
                    outputs = self.engine.step()
                except StageFailure as e:
                    self._give_back(str(e))
                    break
                if c.slowdown > 0:
                    self.stop_event.wait(c.slowdown * (time.monotonic() - t0))
                self._finish(outputs)
                if max_queries is not None and self.finished >= max_queries:
                    break
        finally:
            self.stop_event.set()
            keeper.join(timeout=2)
        log.info("worker %s stopped after %d queries", self.worker_id, self.finished)
        return self.finished

    def stop(self) -> None:
        self.stop_event.set()

    def _give_back(self, why: str) -> None:
        """The engine cannot go on: every query it holds goes back to the queue at once, for another worker."""
        self.failure = why
        with self._lock:
            gids = list(self.inflight)
            self.inflight.clear()
        n = self.queue.release(self.config.cluster, gids)
        log.error(
            "engine failed: %s; gave %d in-flight queries back to the queue of %s",
            why,
            n,
            self.config.cluster,
        )

    # ------------------------------------------------------------------ steps of the loop

    def _admit(self) -> None:
        n = self.engine.free_slots()
        if n <= 0:
            return
        claimed = self.queue.claim(self.config.cluster, n, self.worker_id, self.config.lease_s)
        for cq in claimed:
            q = cq.query
            sampling = SamplingParams(
                temperature=q.temperature,
                top_p=q.top_p or 1.0,
                seed=q.seed,
                max_tokens=q.max_tokens,
                forced_length=q.forced_length,
            )
            with self._lock:
                self.inflight[q.gid] = cq
            try:
                self.engine.add_request(
                    Request(
                        q.gid,
                        q.prompt,
                        sampling,
                        predicted_tokens=int(q.predicted_tokens) or None,
                        arrival_time=cq.claimed_at,
                    )
                )
            except (ValueError, RuntimeError) as e:  # a query the engine cannot run fails alone
                log.error("query %s rejected by the engine: %s", q.gid, e)
                self._finish(
                    [RequestOutput(q.gid, "", [], 0, "error", finish_time=time.time(), error=str(e))]
                )
        if claimed:
            log.debug("claimed %d queries", len(claimed))

    def _check_cancelled(self) -> None:
        with self._lock:
            batches = {cq.query.batch_id for cq in self.inflight.values()}
        if not batches:
            return
        statuses = self.queue.batch_statuses(batches)
        cancelled = {b for b, s in statuses.items() if s in ("cancelling", "cancelled")}
        if cancelled:
            with self._lock:
                victims = [g for g, cq in self.inflight.items() if cq.query.batch_id in cancelled]
            for g in victims:
                self.engine.abort_request(g)

    def _check_removed(self) -> None:
        removed = self.queue.cluster_state(self.config.cluster) == "removed"
        if removed != self.removed:
            log.warning(
                "cluster %s was %s",
                self.config.cluster,
                "removed: claiming nothing more" if removed else "re-added",
            )
        self.removed = removed

    def _finish(self, outputs: list[RequestOutput]) -> None:
        observed = []
        for out in outputs:
            with self._lock:
                cq = self.inflight.pop(out.request_id, None)
            if cq is None:
                continue
            q = cq.query
            kind = {"abort": "cancelled", "error": "failed"}.get(out.finish_reason, "completed")
            result = {
                "batch_id": q.batch_id,
                "query_id": q.query_id,
                "text": out.text,
                "prompt_tokens": out.prompt_tokens,
                "completion_tokens": out.completion_tokens,
                "cluster": self.config.cluster,
                "timings": {
                    "enqueued_at": cq.enqueued_at,
                    "started_at": cq.claimed_at,
                    "first_token_at": out.first_token_time,
                    "finished_at": out.finish_time or time.time(),
                },
                "finish_reason": "cancelled" if kind == "cancelled" else out.finish_reason,
                "error": out.error,
                "predicted_tokens": q.predicted_tokens,
                "attempts": cq.attempts,
            }
            idx = self.queue.complete(q.gid, result, kind, out.completion_tokens)
            if idx < 0:
                log.info("query %s already had a result (it ran twice); kept the first", q.gid)
            self.finished += 1
            if kind == "completed" and self.config.record_observed and q.forced_length is None:
                observed.append(
                    {
                        "prompt": q.prompt,
                        "length": out.completion_tokens,
                        "source": q.metadata.get("source", ""),
                        "cluster": self.config.cluster,
                        "predicted": q.predicted_tokens,
                    }
                )
        self.queue.record_observed(observed)

    def _keep_alive(self) -> None:
        c = self.config
        period = max(0.05, min(c.heartbeat_s, c.lease_s / 3))
        while not self.stop_event.wait(period):
            try:
                with self._lock:
                    gids = list(self.inflight)
                self.queue.renew(c.cluster, gids, c.lease_s)
                s = self.engine.stats()
                remaining = 0.0
                with self._lock:
                    for cq in self.inflight.values():
                        remaining += cq.query.predicted_tokens
                self.queue.heartbeat(
                    c.cluster,
                    c.heartbeat_ttl_s,
                    worker=self.worker_id,
                    backend=c.backend,
                    running=s.running,
                    waiting=s.waiting,
                    inflight=len(gids),
                    kv_used_tokens=s.kv_used_tokens,
                    kv_total_tokens=s.kv_total_tokens,
                    tokens_per_s=round(s.tokens_per_s / (1.0 + c.slowdown), 3),
                    generated_tokens=s.generated_tokens,
                    running_remaining_tokens=remaining,
                    capacity_hint_tps=c.capacity_hint_tps,
                    plan_tps=c.plan_tps,
                )
            except Exception as e:  # Redis hiccup: keep trying, leases have slack
                log.warning("heartbeat failed: %s", e)


# ---------------------------------------------------------------------- CLI glue


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cluster", required=True, help="cluster name (its Redis queue is fb:c:NAME:queue)")
    p.add_argument("--redis-url", default=None, help=f"Redis URL (default: ${URL_ENV})")
    p.add_argument(
        "--backend",
        choices=("native", "static", "vllm"),
        default="native",
        help="native: iteration-level engine; static: HF generate on padded batches; vllm: GPU only",
    )
    p.add_argument(
        "--model", default=None, help="local Hugging Face model directory (default: a random model)"
    )
    p.add_argument(
        "--arch", default="llama", choices=("llama", "gpt2", "opt"), help="architecture of the random model"
    )
    p.add_argument("--size", default="tiny", help="size of the random model: nano, tiny, small, base")
    p.add_argument(
        "--plan", default=None, help="plan.json from `planner plan` (layer bits, micro-batch sizes)"
    )
    p.add_argument(
        "--rendezvous",
        default=None,
        help="torch.distributed rendezvous of a multi-stage plan's stage processes, tcp://HOST:PORT "
        "(default: a free port on 127.0.0.1)",
    )
    p.add_argument("--max-batch", type=int, default=8, help="most queries running at once")
    p.add_argument(
        "--capacity", type=float, default=0.0, help="capacity hint in tokens/s (default: measured)"
    )
    p.add_argument(
        "--slowdown",
        type=float,
        default=0.0,
        help="sleep this multiple of each step's time (mimic a slower GPU)",
    )
    p.add_argument(
        "--lease-s", type=float, default=15.0, help="lease of a claimed query; renewed while it runs"
    )
    p.add_argument("--heartbeat-s", type=float, default=1.0, help="heartbeat period")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics here (per pipeline stage: compute, idle, emulated time, memory, "
        "measured and plan-predicted decode latency)",
    )
    p.add_argument("--max-queries", type=int, default=None, help="exit after this many queries (tests)")


def build_engine(args: argparse.Namespace) -> Engine:
    """The engine for ``args.backend``, with its model."""
    if args.backend == "vllm":
        from engines.vllm_backend import VLLMEngine

        return VLLMEngine.from_args(args)
    if args.backend == "native":
        from engines.engine import EngineConfig, LLMEngine

        config = EngineConfig(max_running=args.max_batch)
        if args.plan:
            config.plan_path = args.plan
            config.pipeline.init_method = args.rendezvous
        return LLMEngine.from_pretrained(args.model, arch=args.arch, size=args.size, config=config)
    from engines.static_engine import StaticBatchEngine
    from localmodels import load_or_build

    model, tokenizer = load_or_build(args.model, arch=args.arch, size=args.size)
    return StaticBatchEngine(model, tokenizer, max_batch=args.max_batch)


def run_serve(args: argparse.Namespace) -> int:
    import torch

    url = args.redis_url or os.environ.get(URL_ENV)
    if not url:
        log.error("no Redis URL: pass --redis-url or set $%s (`gateway up` sets it for its engines)", URL_ENV)
        return 2
    if args.max_batch < 1:
        log.error("--max-batch must be >= 1")
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        queue = WorkQueue(connect(url))
    except ConnectionError as e:
        log.error("%s", e)
        return 1
    try:
        engine = build_engine(args)
    except (FileNotFoundError, ValueError, ImportError) as e:
        log.error("cannot build the %s engine: %s", args.backend, e)
        return 2
    config = WorkerConfig(
        cluster=args.cluster,
        lease_s=args.lease_s,
        heartbeat_s=args.heartbeat_s,
        backend=args.backend,
        capacity_hint_tps=args.capacity,
        slowdown=args.slowdown,
    )
    worker = Worker(queue, engine, config)
    signal.signal(signal.SIGTERM, lambda *_: worker.stop())
    signal.signal(signal.SIGINT, lambda *_: worker.stop())
    try:
        if args.metrics_port is not None:
            serve_metrics(engine, args.metrics_port)
            log.info("Prometheus metrics on :%d/metrics", args.metrics_port)
        worker.run(max_queries=args.max_queries)
    finally:
        close = getattr(engine, "close", None)
        if close is not None:
            close()
    if worker.failure:
        log.error("worker stopped: %s", worker.failure)
        return 1
    return 0
