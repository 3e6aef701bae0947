"""The Redis worker of one cluster: queue -> engine -> results, with leases and heartbeats.

The loop takes only as many queries as the engine can admit soon (``free_slots``), so
work that has not started stays in Redis where an idle cluster can take it. A background
thread renews the leases of in-flight queries and publishes the cluster heartbeat
(running, waiting, KV used/free, measured tokens/s), so a long engine step never lets a
lease lapse, while a dead worker's leases do lapse and its queries are requeued. A claim made
when the last renewal is over a third of a lease old (after an outage, a stopped process)
carries the worker's renewals, so its queries requeued meanwhile come back to it rather than
being handed out as new work; other claims carry none (O(claimed) in Redis). A Redis
outage does not stop the worker: results wait in memory (still leased) and every call to Redis
is retried with exponential backoff until it answers again.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, replace

import redis

from engines.device import DeviceClock, StepCost
from engines.emulation import stamped
from engines.interface import Engine, EngineStats, Request, RequestOutput, SamplingParams
from engines.pipeline import StageFailure
from workqueue import ClaimedQuery, Observation, QueryResult, QueryState, WorkQueue, outcome
from workqueue.records import CANCELLED_BATCH_STATES, Timings

log = logging.getLogger(__name__)

#: errors after which Redis may answer again (down, restarting, loading its data)
REDIS_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)


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
    redis_backoff_max_s: float = 5.0  # longest wait between retries while Redis is unreachable
    # Emulated device: each step lasts (1 + slowdown) x its compute time, sleeping the rest. Compute
    # time is the process's CPU time (wall time when threads ran in parallel), so a busy shared CPU,
    # which stretches wall time but not CPU time, does not slow the emulated device down.
    slowdown: float = 0.0
    # Emulated device by cost model (engines.device): each step lasts what its forward passes cost on
    # the modelled device (its compute, when that took longer: an overrun), whatever this CPU's speed
    device_cost: StepCost | None = None
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
        self._unsent: list[tuple[ClaimedQuery, RequestOutput]] = []  # finished, result not yet written
        self._stats = EngineStats()  # the engine's stats, taken on the main loop after each step
        self.kv_token_seconds = 0.0  # KV held x wall time of each step (emulated slowdown included)
        self.device = DeviceClock()  # steps and seconds of the emulated device (--device-cost)
        self._registered = False
        self._last_requeue = self._last_cancel = 0.0
        self._retry_at = 0.0  # when the loop may ask Redis again (backoff after an error)
        self._backoff = 0.0
        self._down_since: float | None = None
        self.renewed_at = time.monotonic()  # when the last renewal of every lease it held began

    # ------------------------------------------------------------------ main loop

    def run(self, max_queries: int | None = None) -> int:
        """Serve until stopped (or until ``max_queries`` have finished); returns how many finished.

        Redis errors never end the loop: the engine keeps stepping on what it holds, finished
        results wait in memory, and the queue work is retried with exponential backoff until
        Redis answers again (the lease keeper keeps trying on its own).
        """
        c = self.config
        self._stats = self.engine.stats()
        keeper = threading.Thread(target=self._keep_alive, name="lease-keeper", daemon=True)
        keeper.start()
        log.info("worker %s serving cluster %r with the %s backend", self.worker_id, c.cluster, c.backend)
        idle_sleep = c.idle_poll_s
        wake = self.queue.wake_listener(c.cluster)  # ends an idle wait when queries land in our queue
        try:
            while not self.stop_event.is_set():
                failure = getattr(getattr(self.engine, "pipeline", None), "failure", None)
                if failure:  # a stage died while the engine was idle
                    self._give_back(f"pipeline stopped: {failure}")
                    break
                if time.monotonic() >= self._retry_at:
                    self._guarded(self._queue_work)
                if not self.engine.has_unfinished():
                    if not wake.wait(idle_sleep):  # announced work: ask the queue again at once
                        idle_sleep = min(c.idle_poll_max_s, idle_sleep * 2)
                    continue
                idle_sleep = c.idle_poll_s
                t0, cpu0 = time.monotonic(), time.process_time()
                try:
                    outputs = self.engine.step()
                except StageFailure as e:
                    self._give_back(str(e))
                    break
                self._stats = self.engine.stats()  # taken here, read by the lease keeper
                outputs = self._emulate_device(t0, cpu0, outputs)
                self.kv_token_seconds += self._stats.kv_step_tokens * (time.monotonic() - t0)
                self._finish(outputs)
                if self._unsent and time.monotonic() >= self._retry_at:
                    self._guarded(self._flush)
                if max_queries is not None and self.finished >= max_queries:
                    break
        finally:
            self.stop_event.set()
            wake.close()
            keeper.join(timeout=2)
            if self._unsent:  # one last try; what cannot be written is re-run after its lease lapses
                self._guarded(self._flush)
        if c.device_cost is not None and self.device.steps:
            log.info("emulated device: %s", self.device.describe())
        log.info("worker %s stopped after %d queries", self.worker_id, self.finished)
        return self.finished

    def _emulate_device(self, t0: float, cpu0: float, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Make the step last what the emulated device takes for it (``device_cost`` or ``slowdown``),
        and stamp the queries it finished with the end of the step on that device: a query is done
        when the device's last pass over it is, not when this CPU's was."""
        c = self.config
        wall = time.monotonic() - t0
        if c.device_cost is not None:
            device_s = c.device_cost.forwards_s(self._stats.step_forwards)
            self.device.record(device_s, wall)
        elif c.slowdown > 0:
            device_s = (1.0 + c.slowdown) * min(wall, time.process_time() - cpu0)
        else:
            return outputs
        if device_s <= wall:
            return outputs
        step_start = time.time() - wall
        self.stop_event.wait(device_s - wall)
        return stamped(outputs, step_start, time.time())

    def device_totals(self) -> tuple[int, int]:
        """Emulated device steps and overruns: the worker's (``--device-cost``) + the stages' (``plan``)."""
        s = self._stats
        return self.device.steps + s.device_steps, self.device.overrun_steps + s.device_overrun_steps

    def _queue_work(self) -> None:
        """Everything the loop asks of Redis: register, requeue lapsed leases, cancellations, claims, results."""
        c, now = self.config, time.monotonic()
        if not self._registered:
            self.queue.register_cluster(
                c.cluster,
                backend=c.backend,
                capacity_hint_tps=c.capacity_hint_tps or None,
                plan_tps=c.plan_tps or None,
                max_query_tokens=c.max_query_tokens or None,
            )
            self._registered = True
        self._flush()  # results first: after an outage they must not lose to the requeue below
        if now - self._last_requeue > c.requeue_check_s:
            self._renew_all()  # lapsed in an outage: still ours
            n = self.queue.requeue_expired(c.cluster)
            if n:
                log.warning("requeued %d queries whose worker stopped renewing its lease", n)
            self._last_requeue = now
        if now - self._last_cancel > c.cancel_check_s:
            self._check_cancelled()
            self._check_removed()
            self._last_cancel = now
        if not self.removed:
            self._admit()

    def _guarded(self, fn) -> None:
        """Run ``fn``; on a Redis error back off exponentially (the loop carries on without Redis)."""
        waiting = len(self._unsent)
        try:
            fn()
        except REDIS_ERRORS as e:
            if self._down_since is None:
                self._down_since = time.monotonic()
                log.warning("Redis unavailable (%s); retrying with backoff, the engine carries on", e)
            self._backoff = min(self.config.redis_backoff_max_s, max(0.1, self._backoff * 2))
            self._retry_at = time.monotonic() + self._backoff
            return
        if self._down_since is not None:
            log.warning(
                "Redis is back after %.1f s; %d results were waiting",
                time.monotonic() - self._down_since,
                waiting,
            )
            self._down_since = None
        self._backoff = 0.0

    def stop(self) -> None:
        self.stop_event.set()

    def _give_back(self, why: str) -> None:
        """The engine cannot go on: every query it holds goes back to the queue at once, for another worker."""
        self.failure = why
        self._guarded(self._flush)  # finished queries keep their results
        with self._lock:
            unsent = {cq.query.gid for cq, _ in self._unsent}
            gids = [g for g in self.inflight if g not in unsent]
            for g in gids:
                del self.inflight[g]
        try:
            n = self.queue.release(self.config.cluster, gids)
        except REDIS_ERRORS as e:  # their leases lapse instead
            log.error("could not give queries back (%s); their leases will lapse", e)
            n = 0
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
        started = time.monotonic()
        stale = started - self.renewed_at > self.config.lease_s / 3  # after an outage: take ours back
        with self._lock:
            mine = list(self.inflight) if stale else []
        claimed = self.queue.claim(self.config.cluster, n, self.worker_id, self.config.lease_s, renew=mine)
        if stale:
            self.renewed_at = started
        for cq in claimed:
            q = cq.query
            with self._lock:
                running = self.inflight.get(q.gid)
                self.inflight[q.gid] = cq if running is None else replace(cq, claimed_at=running.claimed_at)
            if running is not None:  # already ours (the claim never hands it twice): keep running it
                continue
            sampling = SamplingParams(q.temperature, q.top_p or 1.0, q.seed, q.max_tokens, q.forced_length)
            predicted = int(q.predicted_tokens) or None
            try:
                self.engine.add_request(
                    Request(q.gid, q.prompt, sampling, predicted_tokens=predicted, arrival_time=cq.claimed_at)
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
        cancelled = {b for b, s in statuses.items() if s in CANCELLED_BATCH_STATES}
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
        """Queue finished queries' results for writing (``_flush``); they stay leased until written."""
        with self._lock:
            for out in outputs:
                cq = self.inflight.get(out.request_id)
                if cq is not None:
                    self._unsent.append((cq, out))

    def _flush(self) -> None:
        """Write waiting results, each once (a result already there is kept); stops at a Redis error."""
        observed: list[Observation] = []
        try:
            while self._unsent:
                cq, out = self._unsent[0]
                how = outcome(out.finish_reason, out.error)
                kind = how.state
                idx = self.queue.complete(
                    cq.query.gid, self._result(cq, out, kind), kind, out.completion_tokens
                )
                self._unsent.pop(0)
                with self._lock:
                    self.inflight.pop(cq.query.gid, None)
                self.finished += 1
                q = cq.query
                if idx < 0:
                    log.info("query %s already had a result (it ran twice); kept the first", q.gid)
                elif how.answered and self.config.record_observed and q.forced_length is None:
                    observed.append(
                        Observation(
                            q.prompt,
                            out.completion_tokens,
                            q.metadata.get("source", ""),
                            self.config.cluster,
                            q.predicted_tokens,
                        )
                    )
        finally:
            if observed:
                self.queue.record_observed(observed)

    def _result(self, cq: ClaimedQuery, out: RequestOutput, kind: QueryState) -> QueryResult:
        """The result record of a finished query (every field set)."""
        q = cq.query
        return QueryResult(
            batch_id=q.batch_id,
            query_id=q.query_id,
            text=out.text,
            prompt_tokens=out.prompt_tokens,
            completion_tokens=out.completion_tokens,
            cluster=self.config.cluster,
            timings=Timings(
                enqueued_at=cq.enqueued_at,
                started_at=cq.claimed_at,
                first_token_at=out.first_token_time,
                finished_at=out.finish_time or time.time(),
            ),
            finish_reason="cancelled" if kind == QueryState.CANCELLED else out.finish_reason,
            error=out.error,
            predicted_tokens=q.predicted_tokens,
            attempts=cq.attempts,
        )

    def _renew_all(self) -> list[str]:
        """Renew (or take back, after a lapse) the lease of every query it runs; returns their gids."""
        started = time.monotonic()
        with self._lock:
            gids = list(self.inflight)
        self.queue.renew(self.config.cluster, gids, self.config.lease_s, self.worker_id)
        self.renewed_at = started
        return gids

    def _keep_alive(self) -> None:
        c = self.config
        period = max(0.05, min(c.heartbeat_s, c.lease_s / 3))
        while not self.stop_event.wait(period):
            try:
                gids = self._renew_all()
                s = self._stats
                device_steps, device_overruns = self.device_totals()
                with self._lock:
                    remaining = sum((cq.query.predicted_tokens for cq in self.inflight.values()), 0.0)
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
                    kv_step_tokens=s.kv_step_tokens,
                    kv_token_seconds=round(self.kv_token_seconds, 3),
                    tokens_per_s=round(s.tokens_per_s, 3),  # measured between steps: emulated sleep included
                    generated_tokens=s.generated_tokens,
                    running_remaining_tokens=remaining,
                    capacity_hint_tps=c.capacity_hint_tps,
                    plan_tps=c.plan_tps,
                    device_steps=device_steps,  # --device-cost: steps, and those its compute outlasted
                    device_overrun_steps=device_overruns,
                )
            except Exception as e:  # Redis hiccup: keep trying, leases have slack
                log.warning("heartbeat failed: %s", e)
