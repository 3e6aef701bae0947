"""The queue agent: a worker's thread that does all its Redis work, so the engine never waits on it.

An engine in one cloud may reach the queue's Redis in another, 20-150 ms away. The step loop
(:mod:`engines.worker`) therefore never calls Redis: it takes claimed queries from the agent's
inbox, hands it finished outputs, and aborts what the agent says was cancelled. The agent runs
ticks, each one round trip (:mod:`workqueue.worker_tick`), whenever something is due:

* **results**: every output finished since the last tick, written once each (a result already
  there is kept), with their observed lengths in the next tick;
* **leases**: every query it holds (waiting in the inbox, running, finished but not written) is
  renewed every :attr:`WorkerConfig.renew_every_s`, with the heartbeat; lapsed leases of the
  cluster are requeued every ``requeue_check_s``;
* **claims ahead**: the inbox is kept at what the engine can take now plus the queries for
  the next three ticks (round trips) at the engine's measured rate, counted in predicted
  tokens, for at most ``claim_ahead_s`` and a third of the lease, and never more than
  ``max_ahead`` queries beyond what the engine can take. A bounded horizon keeps work that has not started in the queue, where the
  offloader can move it to an idle cluster;
* **cancels and removal**: each tick reads the statuses of the batches it holds and the
  cluster's state. Cancelled queries still in the inbox are answered ``cancelled`` at once,
  running ones are aborted by the step loop; a removed cluster claims nothing more;
* **checkpoints and notices** (:mod:`engines.checkpoints`): the running queries' partial outputs
  the step loop snapshotted, and the queries it gives back under a preemption notice, go in the
  next tick; a notice the cluster's state carries stops the claims.

A Redis outage never stops the engine: ticks back off exponentially while the engine runs what
it holds, results waiting in memory, still leased. An idle agent waits on its wake channel.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import replace

from engines.agent_records import claim_ahead, heartbeat_record, observation
from engines.checkpoints import Checkpoints
from engines.interface import RequestOutput
from engines.result_record import finished_record
from engines.worker_config import REDIS_ERRORS, WorkerConfig
from workqueue import ClaimedQuery, WorkQueue
from workqueue.records import STOPPING_BATCH_STATES
from workqueue.worker_tick import PendingObservations, TickReply, TickRequest, run_tick

log = logging.getLogger(__name__)


class QueueAgent:
    """Keeps work ahead of one engine and writes what it finishes (see the module's docstring).
    ``free_slots`` (set by the step loop): how many more queries the engine can take now;
    ``rate_tps``: its measured tokens/s; ``heartbeat_fields``: the engine's part of the heartbeat."""

    def __init__(
        self,
        queue: WorkQueue,
        config: WorkerConfig,
        worker_id: str,
        *,
        register: Mapping[str, float | int | str | None],
        rate_tps: Callable[[], float],
        heartbeat_fields: Callable[[], dict[str, float | int | str]],
        checkpoints: Checkpoints | None = None,
    ) -> None:
        self.queue, self.config, self.worker_id = queue, config, worker_id
        self.checkpoints = checkpoints if checkpoints is not None else Checkpoints(0)
        self._register: Mapping | None = register
        self._rate_tps, self._heartbeat_fields = rate_tps, heartbeat_fields
        self._lock = threading.Lock()
        self.inflight: dict[str, ClaimedQuery] = {}  # claimed and not written: inbox, running, finished
        self.inbox: deque[ClaimedQuery] = deque()  # claimed, not yet given to the engine
        self._outbox: list[tuple[ClaimedQuery, RequestOutput]] = []  # finished, result not written
        self._observed = PendingObservations()  # written, to record with the next tick (once: its call id)
        self._aborts: set[str] = set()  # running queries of cancelled batches, for the step loop
        self._aborted: set[str] = set()
        self.work_ready = threading.Event()  # the inbox has queries
        self._kick = threading.Event()  # something may be due
        self._stop = threading.Event()
        self.free_slots = 0
        self.finished = 0  # results written
        self.removed = False  # `fleetbatch gateway rebalance --remove`: claim nothing more
        self.renewed_at = time.monotonic()  # when the last renewal of every lease it held began
        self.tick_s = 0.0  # a tick's duration (moving average): the round trip, mostly
        self.ticks = 0
        self._mean_predicted = 0.0  # predicted tokens of the queries claimed (moving average)
        self._last_heartbeat = self._last_requeue = self._last_read = -math.inf
        self._poll_at, self._poll_s = 0.0, config.idle_poll_s  # an empty queue is asked again then
        self._wakes = 0  # work announcements seen (one during a tick keeps the next claim at once)
        self._backoff, self._down_since = 0.0, None
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------------ the step loop's side

    def take(self, n: int) -> list[ClaimedQuery]:
        """Up to ``n`` claimed queries for the engine, oldest first."""
        with self._lock:
            out = [self.inbox.popleft() for _ in range(min(n, len(self.inbox)))]
            self.free_slots = max(0, self.free_slots - len(out))  # until the step loop says again
            if not self.inbox:
                self.work_ready.clear()
        if out:
            self._kick.set()  # the inbox shrank: claim ahead again
        return out

    def aborts(self) -> list[str]:
        """Running queries whose batch was cancelled (each returned once)."""
        with self._lock:
            out = sorted(self._aborts)
            self._aborts.clear()
        return out

    def done(self, outputs: list[RequestOutput]) -> None:
        """Finished outputs: their results are written by the next tick (they stay leased until then)."""
        if not outputs:
            return
        with self._lock:
            for out in outputs:
                cq = self.inflight.get(out.request_id)
                if cq is not None:
                    self._outbox.append((cq, out))
        self._kick.set()

    def unwritten(self) -> int:
        with self._lock:
            return len(self._outbox)

    def kick(self) -> None:  # something is due (a checkpoint to send): tick soon
        self._kick.set()

    # ------------------------------------------------------------------ the agent's thread

    def start(self) -> None:
        wake = self.queue.wake_listener(self.config.cluster)
        self._threads = [
            threading.Thread(target=self._run, name="queue-agent", daemon=True),
            threading.Thread(target=self._listen, args=(wake,), name="queue-wake", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _listen(self, wake) -> None:
        try:
            while not self._stop.is_set():
                if wake.wait(0.5):
                    self.poll_now()
        finally:
            wake.close()

    def poll_now(self) -> None:
        """Work was announced: ask the queue at once, whatever the poll back-off says."""
        self._wakes += 1
        self._poll_at = 0.0
        self._kick.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._kick.clear()
            req = self.request()
            if req is None:
                self._kick.wait(self._wait_s())
                continue
            try:
                ok = self.tick(req)
            except Exception:  # a refused command, a bad reply: log it, back off, carry on
                log.exception("queue agent tick failed; retrying with backoff")
                self._back_off()
                ok = False
            self._stop.wait(self.config.min_tick_s if ok else self._backoff)

    def stop(self) -> bool:
        """Stop ticking (the last results are written by :meth:`close`); False if a tick still runs."""
        self._stop.set()
        self._kick.set()
        for t in self._threads:  # a tick ends within the client's timeout and retries (3 x 5 s)
            t.join(timeout=30)
        return not any(t.is_alive() for t in self._threads)

    def _back_off(self) -> None:
        """A failed tick: the next waits twice as long as the last (0.1 s to ``redis_backoff_max_s``)."""
        self._backoff = min(self.config.redis_backoff_max_s, max(0.1, self._backoff * 2))

    def alive(self) -> bool:
        """The agent's thread runs (False before :meth:`start` and after it stopped)."""
        return bool(self._threads) and self._threads[0].is_alive()

    def close(self, give_back: bool = False) -> int:
        """Stop, write the results still waiting (one try), and give back the queries not started (all
        it holds with ``give_back``: the engine failed); returns how many went back to the queue."""
        if not self.stop():
            log.error("the queue agent is still in a tick; results not written stay leased until they lapse")
            return 0
        if self.unwritten() or self.checkpoints.pending():
            c = self.config
            self.tick(TickRequest(c.cluster, self.worker_id, c.lease_s, read_state=False, **self._results()))
        with self._lock:
            unsent = {cq.query.gid for cq, _ in self._outbox}
            waiting = [cq.query.gid for cq in self.inbox]
            running = (
                [g for g in self.inflight if g not in unsent and g not in set(waiting)] if give_back else []
            )
            for g in waiting + running:
                self.inflight.pop(g, None)
            self.inbox.clear()
        n = 0
        for gids, started in ((waiting, False), (running, True)):  # never started: no attempt used
            try:
                n += self.queue.release(self.config.cluster, gids, worker=self.worker_id, started=started)
            except REDIS_ERRORS as e:  # their leases lapse instead
                log.error("could not give queries back (%s); their leases will lapse", e)
        return n

    # ------------------------------------------------------------------ one tick

    def request(self) -> TickRequest | None:
        """What is due now, as one tick's request (None: nothing)."""
        c, now = self.config, time.monotonic()
        req = TickRequest(c.cluster, self.worker_id, c.lease_s, register=self._register, **self._results())
        # not renewed: a renewal (or the claim's) would take them back; read after the tick's checkpoints
        releasing = self.checkpoints.releasing()
        with self._lock:
            held = [g for g in self.inflight if g not in releasing]
            batches = sorted({cq.query.batch_id for cq in self.inflight.values()})
        if held and now - self.renewed_at >= c.renew_every_s:
            req.renew = held
        req.requeue = now - self._last_requeue >= c.requeue_check_s
        if not self.removed and not self.checkpoints.noticed and now >= self._poll_at:
            req.claim = self.claim_count()
        req.batches = batches
        req.read_state = now - self._last_read >= c.cancel_check_s
        if now - self._last_heartbeat >= c.renew_every_s:
            req.heartbeat, req.heartbeat_ttl_s = self._heartbeat(), c.heartbeat_ttl_s
        parts = (req.register, req.results, req.observed, req.renew, req.requeue, req.claim, req.checkpoints)
        due = any(parts)
        if not (due or req.read_state or req.heartbeat is not None):
            return None
        return req

    def _checkpoints(self) -> list:
        """The checkpoints to send, but those of queries whose result is waiting (their hash goes with it)."""
        with self._lock:
            finished = [cq.query.gid for cq, _ in self._outbox]
        return self.checkpoints.for_tick(skip=finished)

    def _results(self) -> dict:
        with self._lock:
            outbox = list(self._outbox)
        observed, call = self._observed.for_tick()
        return {
            "results": [finished_record(self.config.cluster, cq, out) for cq, out in outbox],
            "observed": observed,
            "observed_call": call,
            "length_model": self.config.length_model,
            "checkpoints": self._checkpoints(),
        }

    def claim_count(self) -> int:
        """Queries to claim now: what the engine can take, plus the claim-ahead horizon's (module docstring)."""
        with self._lock:
            inbox = list(self.inbox)
        return claim_ahead(
            self.config, self.free_slots, inbox, self._mean_predicted, self._rate_tps(), self.tick_s
        )

    def tick(self, req: TickRequest | None = None) -> bool:
        """Run one tick (``req``, or what is due); False when Redis did not answer (it backs off)."""
        req = req if req is not None else self.request()
        if req is None:
            return True
        started, wakes = time.monotonic(), self._wakes
        try:
            reply = run_tick(self.queue, req)
        except REDIS_ERRORS as e:
            if self._down_since is None:
                self._down_since = started
                log.warning("Redis unavailable (%s); retrying with backoff, the engine carries on", e)
            self._back_off()
            return False
        took = time.monotonic() - started
        self.tick_s = took if not self.ticks else 0.8 * self.tick_s + 0.2 * took
        self.ticks += 1
        if self._down_since is not None:
            log.warning(
                "Redis is back after %.1f s; %d results were waiting",
                started - self._down_since,
                len(req.results),
            )
            self._down_since = None
        self._backoff = 0.0
        self._apply(req, reply, started, wakes)
        return True

    def _apply(self, req: TickRequest, reply: TickReply, started: float, wakes: int) -> None:
        self._register = None
        self._observed.written(len(req.observed))
        written = {f.gid: idx for f, idx in zip(req.results, reply.written, strict=True)}
        with self._lock:
            outbox = [(cq, out) for cq, out in self._outbox if cq.query.gid not in written]
            for cq, out in self._outbox:
                if cq.query.gid in written:
                    self.inflight.pop(cq.query.gid, None)
                    self._observe(cq, out, written[cq.query.gid])
            self._outbox = outbox
            self._aborted -= written.keys()
        self.finished += len(written)
        if req.checkpoints:
            released = self.checkpoints.applied(req.checkpoints)
            with self._lock:
                for g in released:  # given back: no longer this worker's
                    self.inflight.pop(g, None)
        if req.renew is not None:
            self.renewed_at = started
        if req.requeue:
            self._last_requeue = started
            if reply.requeued:
                log.warning("requeued %d queries whose worker stopped renewing its lease", reply.requeued)
        if req.heartbeat is not None:
            self._last_heartbeat = started
        if req.claim:
            self._claimed(reply.claimed, req.claim, wakes)
        self._cancel({b for b, s in reply.statuses.items() if s in STOPPING_BATCH_STATES})
        if reply.state is not None:
            self._last_read = started
            left = reply.notice_left_s
            if left is not None and self.checkpoints.notice(started + left):
                log.warning("cluster %s is preempted: %.1f s of notice", self.config.cluster, left)
            removed = reply.state == "removed"
            if removed != self.removed:
                log.warning(
                    "cluster %s was %s",
                    self.config.cluster,
                    "removed: claiming nothing more" if removed else "re-added",
                )
            self.removed = removed

    def _observe(self, cq: ClaimedQuery, out: RequestOutput, idx: int) -> None:
        row = observation(self.config, cq, out, idx)
        if row is not None:
            self._observed.append(row)

    def _claimed(self, claimed: list[ClaimedQuery], asked: int, wakes: int) -> None:
        with self._lock:
            for cq in claimed:
                running = self.inflight.get(cq.query.gid)
                if running is not None:  # already ours (the claim never hands it twice): keep running it
                    self.inflight[cq.query.gid] = replace(cq, claimed_at=running.claimed_at)
                    continue
                self.inflight[cq.query.gid] = cq
                self.inbox.append(cq)
                p = float(cq.query.predicted_tokens or 0)
                self._mean_predicted = (
                    p if self._mean_predicted <= 0 else 0.9 * self._mean_predicted + 0.1 * p
                )
            if self.inbox:
                self.work_ready.set()
        if len(claimed) < asked and self._wakes == wakes:  # ran dry, no news since: back off (or a wake)
            self._poll_at = time.monotonic() + self._poll_s
            self._poll_s = min(self.config.idle_poll_max_s, self._poll_s * 2)
        else:
            self._poll_at, self._poll_s = 0.0, self.config.idle_poll_s
        if claimed:
            log.debug("claimed %d queries", len(claimed))

    def _cancel(self, batches: set[str]) -> None:
        """Answer the inbox's queries of cancelled ``batches`` and have the step loop abort the running ones."""
        if not batches:
            return
        now = time.time()
        with self._lock:
            dropped = [cq for cq in self.inbox if cq.query.batch_id in batches]
            self.inbox = deque(cq for cq in self.inbox if cq.query.batch_id not in batches)
            outboxed = {cq.query.gid for cq, _ in self._outbox}
            for cq in dropped:
                self._outbox.append((cq, RequestOutput(cq.query.gid, "", [], 0, "abort", finish_time=now)))
            gone = {cq.query.gid for cq in dropped} | outboxed | self._aborted
            victims = {g for g, cq in self.inflight.items() if cq.query.batch_id in batches and g not in gone}
            self._aborts |= victims
            self._aborted |= victims
        if dropped:
            self._kick.set()

    # ------------------------------------------------------------------ records

    def _heartbeat(self) -> dict[str, float | int | str]:
        with self._lock:
            held = list(self.inflight.values())
        return heartbeat_record(self._heartbeat_fields(), self.worker_id, held, len(self.inbox), self.tick_s)

    def _wait_s(self) -> float:
        """How long the idle agent may wait before something falls due."""
        c, now = self.config, time.monotonic()
        due = [self._last_requeue + c.requeue_check_s, self._last_read + c.cancel_check_s]
        due.append(self._last_heartbeat + c.renew_every_s)
        if self.inflight:
            due.append(self.renewed_at + c.renew_every_s)
        if not self.removed and self._poll_at > now:
            due.append(self._poll_at)
        return max(0.001, min(due) - now)
