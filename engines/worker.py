"""The worker of one cluster: its step loop drives the engine, its queue agent talks to Redis.

The step loop never waits on Redis while it has work: it takes claimed queries from the
:class:`~engines.queue_agent.QueueAgent`'s inbox as the engine has room for them, steps, and
hands finished outputs to the agent, which writes them, renews the leases of everything the
worker holds, claims ahead, reads cancels and publishes the heartbeat, each tick in one round
trip, on its own thread (:mod:`engines.queue_agent`). A Redis outage does not stop the engine:
results wait in memory (still leased) while the agent retries with exponential backoff; a dead
worker's leases lapse and its queries are requeued. A claim after an outage renews the worker's
leases first, so its queries requeued meanwhile come back to it rather than being handed out as
new work.

An engine that can resume (:class:`~engines.interface.Resumable`: the native one, the vLLM and endpoint backends) has
its running queries checkpointed every ``checkpoint_tokens`` tokens, and a query claimed with a partial
output resumes from it. Under a preemption notice (:meth:`Worker.notice`, or one the agent reads from the
cluster's state) the worker claims nothing more, gives back what it claimed ahead, lets the queries
that will finish within the notice finish, checkpoints and gives back the others (no attempt used),
and stops once nothing is left (:mod:`engines.checkpoints`).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid

from engines.checkpoints import Checkpoints, doomed
from engines.device import DeviceClock
from engines.emulation import stamped
from engines.interface import (
    Engine,
    EngineFailure,
    EngineStats,
    Request,
    RequestOutput,
    Resumable,
    SamplingParams,
)
from engines.queue_agent import QueueAgent
from engines.worker_config import WorkerConfig
from workqueue import WorkQueue
from workqueue.openai_body import encode_fields, unhonoured
from workqueue.roundtrips import count_round_trips

__all__ = ["Worker", "WorkerConfig"]

log = logging.getLogger(__name__)


class Worker:
    """Drives one :class:`~engines.interface.Engine` from one cluster's queue."""

    def __init__(self, queue: WorkQueue, engine: Engine, config: WorkerConfig):
        self.queue = queue
        self.engine = engine
        self.config = config
        self.worker_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.stop_event = threading.Event()
        self.failure: str | None = None  # why the engine stopped, when it failed
        self._stats = EngineStats()  # the engine's stats, taken on the step loop after each step
        self.kv_token_seconds = 0.0  # KV held x wall time of each step (emulated slowdown included)
        self.device = DeviceClock()  # steps and seconds of the emulated device (--device-cost)
        self.steps = 0
        self.resumed_queries = 0  # started from a partial output an earlier run wrote
        self.resumed_tokens = 0  # the tokens of those partial outputs: not generated again
        # seconds the device was busy: its modelled time when emulated, else the steps' wall time
        self.busy_s = 0.0
        self.host_overlap_s = 0.0  # host time between steps hidden under the device's (_emulate_device)
        self._device_free_at: float | None = None  # when the emulated device finished its last step
        self.round_trips = count_round_trips(queue.r)
        self.resumable = isinstance(engine, Resumable)
        self.checkpoints = Checkpoints(config.checkpoint_tokens if self.resumable else 0)
        self._notice_s: float | None = None  # a notice given by a signal, applied by the step loop
        self._preempting: set[str] = set()  # aborted under a notice (an engine that cannot resume): give back
        self._no_wait_until = 0.0  # a checkpoint was not written in time: step on without waiting until then
        self.agent = QueueAgent(
            queue,
            config,
            self.worker_id,
            register={
                "backend": config.backend,
                "capacity_hint_tps": config.capacity_hint_tps or None,
                "plan_tps": config.plan_tps or None,
                "max_query_tokens": config.max_query_tokens or None,
                "served_model": config.served_model,
                "length_model": config.length_model,  # "" clears a key an earlier run registered
                "openai_fields": encode_fields(config.openai_fields),
            },
            rate_tps=lambda: self._stats.tokens_per_s,
            heartbeat_fields=self._heartbeat_fields,
            checkpoints=self.checkpoints,
        )

    @property
    def finished(self) -> int:
        """Results written."""
        return self.agent.finished

    @property
    def inflight(self) -> dict:
        """Queries claimed and not written (waiting, running or finished), by gid."""
        return self.agent.inflight

    # ------------------------------------------------------------------ the step loop

    def run(self, max_queries: int | None = None) -> int:
        """Serve until stopped (or until ``max_queries`` results are written); returns how many were.

        Redis errors never end the loop: the engine keeps stepping on what it holds while the
        queue agent retries with exponential backoff until Redis answers again.
        """
        c = self.config
        self._stats = self.engine.stats()
        self.agent.free_slots = self.engine.free_slots()
        self.agent.start()
        log.info("worker %s serving cluster %r with the %s backend", self.worker_id, c.cluster, c.backend)
        try:
            while not self.stop_event.is_set():
                if max_queries is not None and self.finished >= max_queries:
                    break
                failure = getattr(getattr(self.engine, "pipeline", None), "failure", None)
                if failure:  # a stage died while the engine was idle
                    self._give_back(f"pipeline stopped: {failure}")
                    break
                if not self.agent.alive():  # it logged why: without it nothing is renewed or written
                    self._give_back("the queue agent stopped")
                    break
                if self._notice_s is None and not self.checkpoints.noticed:
                    self.start_claimed()
                elif self._under_notice():
                    log.info("worker %s: preempted, nothing left to finish or give back", self.worker_id)
                    break
                if not self.engine.has_unfinished():
                    self.agent.work_ready.wait(c.idle_poll_s)
                    continue
                try:
                    self._hold_for_checkpoints()
                    self.step()
                except EngineFailure as e:  # a stage died, no endpoint answers
                    self._give_back(str(e))
                    break
        finally:
            self.stop_event.set()
            if self.failure is None:
                back = self.agent.close()
                if back:
                    log.info("gave %d claimed queries that had not started back to the queue", back)
        if c.device_cost is not None and self.device.steps:
            log.info(
                "emulated device: %s; %.2f s of host time between steps hidden under it (%.3f ms a step)",
                self.device.describe(),
                self.host_overlap_s,
                1000 * self.host_overlap_s / self.device.steps,
            )
        log.info("worker %s stopped after %d queries", self.worker_id, self.finished)
        return self.finished

    def start_claimed(self) -> None:
        """Abort what was cancelled, and give the engine the claimed queries it has room for."""
        for gid in self.agent.aborts():
            self.engine.abort_request(gid)
        resumed = []
        for cq in self.agent.take(self.engine.free_slots()):
            q = cq.query
            sampling = SamplingParams(q.temperature, q.top_p or 1.0, q.seed, q.max_tokens, q.forced_length)
            resume = cq.partial if self.resumable else None
            self.checkpoints.start(q.gid, len(resume or ()))
            predicted = int(q.predicted_tokens) or None
            body = q.openai_body or {}
            try:
                # the gateway refuses these at submission; a row may come before this cluster registered
                missing = unhonoured(body, self.config.openai_fields)
                if missing:
                    raise ValueError(f"the {self.config.backend} backend cannot honour {', '.join(missing)}")
                self.engine.add_request(
                    Request(
                        q.gid,
                        q.prompt,
                        sampling,
                        predicted_tokens=predicted,
                        arrival_time=cq.claimed_at,
                        openai_body=body,
                        cache_salt=q.cache_salt,
                        resume=resume,
                    )  # fmt: skip
                )
                if resume:
                    resumed.append((q.gid, len(resume)))
            except (ValueError, RuntimeError) as e:  # a query the engine cannot run fails alone
                log.error("query %s rejected by the engine: %s", q.gid, e)
                self.agent.done(
                    [RequestOutput(q.gid, "", [], 0, "error", finish_time=time.time(), error=str(e))]
                )
        if resumed:
            self._count_resumed(resumed)
        self.agent.free_slots = self.engine.free_slots()

    def _count_resumed(self, claimed: list[tuple[str, int]]) -> None:
        """Count the queries just started that continue their partial outputs (an engine may start one again
        instead: a row it cannot continue), and the tokens they were spared (at most the partial output's)."""
        progress = self.engine.progress()
        taken = [min(progress.get(g, 0), n) for g, n in claimed]
        queries, tokens = sum(1 for n in taken if n), sum(taken)
        self.resumed_queries += queries
        self.resumed_tokens += tokens
        log.info(
            "worker %s: %d of %d queries claimed with a partial output continue it (%d tokens not generated again)",
            self.worker_id,
            queries,
            len(claimed),
            tokens,
        )

    def step(self) -> None:
        """One engine step (on the emulated device's clock); its finished outputs go to the agent."""
        t0, cpu0 = time.monotonic(), time.process_time()
        outputs = self.engine.step()
        self._stats = self.engine.stats()  # taken here, read by the agent's heartbeat
        outputs = self._emulate_device(t0, cpu0, outputs)
        took = time.monotonic() - t0
        self.kv_token_seconds += self._stats.kv_step_tokens * took
        self.steps += 1
        self.agent.free_slots = self.engine.free_slots()
        if self._preempting:  # aborted under a notice: given back, not answered (an answer first is kept)
            gone = {
                o.request_id
                for o in outputs
                if o.request_id in self._preempting and o.finish_reason == "abort"
            }
            self._preempting -= {o.request_id for o in outputs}
            for g in gone:
                self.checkpoints.release(g, None)
            outputs = [o for o in outputs if o.request_id not in gone]
        self.checkpoints.forget(o.request_id for o in outputs)
        if self.resumable and self.checkpoints.after_step(self.engine.progress(), self.engine.partial):
            self.agent.kick()
        self.agent.done(outputs)

    # ------------------------------------------------------------------ checkpoints and notices

    def notice(self, seconds: float) -> None:
        """A preemption notice of ``seconds`` (SIGTERM under ``--grace-s``): safe in a signal handler."""
        self._notice_s = time.monotonic() + max(0.0, seconds)
        self.agent.work_ready.set()  # an idle step loop looks at once

    def _hold_for_checkpoints(self) -> None:
        """Before a step: wait while a query is a checkpoint ahead of its partial output in Redis (a hard kill
        then loses at most that), unless Redis lately did not write one in time (the engine carries on)."""
        if (
            not self.checkpoints.every
            or not self.engine.steps_generate  # its streams go on between steps: holding one saves nothing
            or time.monotonic() < self._no_wait_until
        ):
            return
        progress = self.engine.progress()
        if not self.checkpoints.behind(progress):
            return
        self.agent.kick()
        if not self.checkpoints.wait_written(progress, self.config.lease_s / 3):
            log.warning(
                "checkpoints not written for %.1f s: stepping on without them", self.config.lease_s / 3
            )
            self._no_wait_until = time.monotonic() + self.config.lease_s

    def _under_notice(self) -> bool:
        """One pass under a notice (the module's docstring); True once nothing is left to finish or give back."""
        if self._notice_s is not None:
            if self.checkpoints.notice(self._notice_s):
                log.warning(
                    "worker %s: preemption notice, %.1f s", self.worker_id, self._notice_s - time.monotonic()
                )
            self._notice_s = None
        for gid in self.agent.aborts():
            self.engine.abort_request(gid)
        for cq in self.agent.take(len(self.agent.inbox)):  # claimed ahead, never started
            self.checkpoints.release(cq.query.gid, None)
        left = (self.checkpoints.notice_at or 0.0) - time.monotonic()
        progress = self.engine.progress() if self.resumable else {}
        skip = self._preempting | self.checkpoints.releasing()
        held = {
            g: cq for g, cq in dict(self.agent.inflight).items() if g not in skip
        }  # a copy: the agent writes it
        running = {  # generated, most it may generate (an engine that cannot resume: what it holds, none generated)
            g: (progress.get(g, 0), cq.query.forced_length or cq.query.max_tokens)
            for g, cq in held.items()
            if g in progress or not self.resumable
        }
        per_query_tps = self._stats.tokens_per_s / max(1, self._stats.running)
        for g in doomed(running, per_query_tps, left):
            if not self.resumable:
                self._preempting.add(g)
                self.engine.abort_request(g)
                continue
            generated = self.engine.suspend(g)
            if generated is not None:  # None: in a micro-batch in flight, or finished: next pass
                self.checkpoints.release(g, generated or None)
        self.agent.free_slots = self.engine.free_slots()
        self.agent.kick()
        if self.engine.has_unfinished():
            return False
        return not self.agent.unwritten() and not self.checkpoints.pending()

    def _emulate_device(self, t0: float, cpu0: float, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Make the step last what the emulated device takes for it (``device_cost`` or ``slowdown``),
        and stamp the queries it finished with the end of the step on that device: a query is done
        when the device's last pass over it is, not when this CPU's was.

        The device keeps its own timeline: up to ``host_overlap_s`` of the host's time since the
        device's end of the last step is hidden under the device's work (the step starts that much
        earlier, never before the last one ended), as with an engine that prepares its next step
        while the device runs the current one. The host time so hidden (Python's bookkeeping
        between steps, a late wake-up) is counted in ``host_overlap_s``; the rest of a gap (no
        work, a stall) is device idle time."""
        c = self.config
        now = time.monotonic()
        wall = now - t0
        if c.device_cost is not None:
            device_s = c.device_cost.forwards_s(self._stats.step_forwards)
            self.device.record(device_s, wall)
        elif c.slowdown > 0:
            device_s = (1.0 + c.slowdown) * min(wall, time.process_time() - cpu0)
        else:
            self.busy_s += wall
            return outputs
        start, free = t0, self._device_free_at
        if free is not None and t0 >= free:  # at most host_overlap_s of the gap is hidden, never more
            start = max(free, t0 - c.host_overlap_s)
            self.host_overlap_s += t0 - start
        end = start + device_s
        if end <= now:  # the compute outlasted the device (an overrun): the step ends now
            self._device_free_at = now
            self.busy_s += now - start
            return outputs
        self.busy_s += device_s
        self.stop_event.wait(end - now)
        self._device_free_at = end
        epoch = time.time() - (time.monotonic() - end)  # when the device was done, not when we woke
        return stamped(outputs, epoch - device_s, epoch)

    @property
    def engine_stats(self) -> EngineStats:
        """The engine's stats as the step loop last took them."""
        return self._stats

    def device_totals(self) -> tuple[int, int]:
        """Emulated device steps and overruns: the worker's (``--device-cost``) + the stages' (``plan``)."""
        s = self._stats
        return self.device.steps + s.device_steps, self.device.overrun_steps + s.device_overrun_steps

    def stop(self) -> None:
        self.stop_event.set()

    def _give_back(self, why: str) -> None:
        """The engine cannot go on: every query it holds goes back to the queue at once, for another worker."""
        self.failure = why
        n = self.agent.close(give_back=True)  # finished queries keep their results
        log.error(
            "engine failed: %s; gave %d in-flight queries back to the queue of %s",
            why,
            n,
            self.config.cluster,
        )

    def _heartbeat_fields(self) -> dict[str, float | int | str]:
        """The step loop's part of the heartbeat (the agent adds its own)."""
        c, s = self.config, self._stats
        device_steps, device_overruns = self.device_totals()
        return {
            "backend": c.backend,
            "running": s.running,
            "waiting": s.waiting,
            "kv_used_tokens": s.kv_used_tokens,
            "kv_total_tokens": s.kv_total_tokens,
            "kv_step_tokens": s.kv_step_tokens,
            "kv_token_seconds": round(self.kv_token_seconds, 3),
            "tokens_per_s": round(s.tokens_per_s, 3),  # measured between steps: emulated sleep included
            "generated_tokens": s.generated_tokens,
            "capacity_hint_tps": c.capacity_hint_tps,
            "plan_tps": c.plan_tps,
            "device_steps": device_steps,  # --device-cost: steps, and those its compute outlasted
            "device_overrun_steps": device_overruns,
            "steps": self.steps,
            "device_busy_s": round(self.busy_s, 4),
            "host_overlap_s": round(self.host_overlap_s, 4),
            "redis_round_trips": self.round_trips.value,
            "prefix_lookup_tokens": s.prefix_lookup_tokens,  # the prefix cache: hit / lookup is its hit rate
            "prefix_hit_tokens": s.prefix_hit_tokens,
        }
