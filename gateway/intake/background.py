"""Background intake: a large batch is accepted durably at once, then predicted, assigned and enqueued in chunks.

``SubmitBatch`` validates a batch (sizes, ids, token counts) and, for a batch of at least
``sync_max_queries`` queries, stores its validated rows in Redis
(:meth:`workqueue.WorkQueue.accept_batch`: one atomic, idempotent creation, the batch
``VALIDATING``) and answers. Every gateway replica runs :meth:`Intake.loop`: it takes the
intake lease of an unfinished batch (``SET NX PX``, one replica per batch at a time, lapsing
when its holder dies), then chunk by chunk reads the next rows, predicts their lengths,
assigns them with the gateway's policy and lands them with one script call
(``ENQUEUE_CHUNK``): queued on their clusters, the batch ``IN_PROGRESS`` from its first chunk
on. A chunk lands only while its lease holds and its cursor is current, so a replica that
lost its lease (or died mid-chunk) never enqueues a row twice, and another replica resumes
where it stopped. A batch cancelled during intake gets its remaining rows finished as
cancelled, none enqueued. Engines start on the first chunk; intake then runs at the
predictor's own pace.

**Fair turns.** :meth:`Intake.tick` is one round over the unfinished intakes, oldest first:
each batch gets one turn of about ``turn`` rows (longer while no other batch waits), then
gives its lease back, so a 1M-query batch never keeps a later batch ``validating`` until it
is done. The round reads the intake set a page (``page`` ids) at a time, so no number of
older batches keeps a later one from its turn; a tick gives at most ``round_batches`` turns
and the next tick goes on from there.

**Waiting for a cluster** (:mod:`gateway.assign.placement`). A chunk with rows that only a cluster
not alive now could take (restarting, loading its model) waits, bounded by ``wait_s``
(``fleetbatch gateway serve --intake-wait-s``), then fails those rows; a row over every configured
cluster's limit fails at once, naming the limit. The waiting chunk is counted and predicted
once: each later poll only places it again (:mod:`gateway.intake.chunks`). **A lost intake list** fails the batch's
rows not yet enqueued once (:meth:`workqueue.WorkQueue.fail_lost_intake`), and the batch
leaves intake.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

from gateway.assign.calibrated import LengthEstimates
from gateway.assign.placement import IntakeWaits, place_or_wait
from gateway.assign.policies import QueryLoad
from gateway.assign.prefixes import Prefix
from gateway.config import INTAKE_WAIT_S
from gateway.intake.chunks import Chunk, Landing, Waiting, cancelled, charges_of, landing, predict_chunk
from gateway.intake.rows import BATCH_OWNER_FIELD, EncodedRows, encode_rows, payload, tenant_salt
from workqueue import WorkQueue, keys
from workqueue.records import STOPPING_BATCH_STATES

log = logging.getLogger(__name__)

__all__ = ["EncodedRows", "Intake", "IntakeSettings", "encode_rows", "payload"]


@dataclass(frozen=True)
class IntakeSettings:
    """When and how batches go through background intake (env ``FLEETBATCH_INTAKE_*`` overrides)."""

    sync_max_queries: int = 2000  # batches with fewer queries are created in SubmitBatch, as before
    chunk: int = 4096  # rows predicted and assigned per step (the predictor batches them sorted by length)
    land: int = 1000  # rows per enqueue script call (keeps each call short for Redis)
    first_chunk: int = 64  # a batch's first step is this small (engines start sooner), then sizes double
    lease_ttl_s: float = 30.0  # a replica that dies holding a batch's intake blocks it this long
    poll_s: float = 0.5  # how often an idle replica looks for unfinished intakes
    pause_s: float = 0.0  # pause between chunks (yields CPU and Redis to other work)
    turn: int = 8192  # rows a batch lands per turn while others wait (no head-of-line blocking)
    page: int = 100  # batch ids read from the intake set per Redis call while a tick goes round
    round_batches: int = 1000  # turns one tick gives at most (the next tick goes on from there)

    @classmethod
    def from_env(cls) -> IntakeSettings:
        env = os.environ.get
        return cls(
            sync_max_queries=int(env("FLEETBATCH_INTAKE_SYNC_MAX", cls.sync_max_queries)),
            chunk=max(1, int(env("FLEETBATCH_INTAKE_CHUNK", cls.chunk))),
            first_chunk=max(1, int(env("FLEETBATCH_INTAKE_FIRST_CHUNK", cls.first_chunk))),
            land=max(1, int(env("FLEETBATCH_INTAKE_LAND", cls.land))),
            lease_ttl_s=float(env("FLEETBATCH_INTAKE_LEASE_S", cls.lease_ttl_s)),
            poll_s=float(env("FLEETBATCH_INTAKE_POLL_S", cls.poll_s)),
            pause_s=float(env("FLEETBATCH_INTAKE_PAUSE_S", cls.pause_s)),
            turn=max(1, int(env("FLEETBATCH_INTAKE_TURN", cls.turn))),
            page=max(1, int(env("FLEETBATCH_INTAKE_PAGE", cls.page))),
            round_batches=max(1, int(env("FLEETBATCH_INTAKE_ROUND", cls.round_batches))),
        )


class IntakeLost(Exception):
    """The batch's intake list is gone; its rows not yet enqueued were counted failed."""


class Intake:
    """Runs the background intake of one gateway replica (see the module docstring)."""

    def __init__(
        self,
        queue: WorkQueue,
        predict_tokens: Callable[[list[str]], LengthEstimates | list[float]],
        assign: Callable[[Sequence[QueryLoad], list], list[str]],
        settings: IntakeSettings,
        on_assigned: Callable[[list[str]], None] = lambda names: None,
        count_tokens: Callable[[list[str]], list[int]] | None = None,
        wait_s: float = INTAKE_WAIT_S,
        order: Callable[[Sequence[QueryLoad]], list[int]] | None = None,
        find_prefixes: Callable[[list[str], list[int]], list[Prefix]] | None = None,
        shared_cache: bool = False,
        assign_takes_batch: bool = False,
    ) -> None:
        """``wait_s``: how long a batch waits for a cluster that can take its rows (``--intake-wait-s``);
        ``order``: the order a chunk's rows enter their queues (indices into its loads; None: the rows');
        ``shared_cache``: no tenant salt in the payloads (``--shared-prefix-cache``); ``assign_takes_batch``:
        ``assign`` takes the batch's id as ``batch_id`` (the cost policy reads its window)."""
        self.shared_cache, self.assign_takes_batch, self.order = shared_cache, assign_takes_batch, order
        self.find_prefixes = find_prefixes  # each row's prefix group (gateway.assign.prefixes): the policy's
        self.wait_s = wait_s
        self.queue = queue
        self.count_tokens = count_tokens
        self.predict_tokens = predict_tokens
        self.assign = assign
        self.settings = settings
        self.on_assigned = on_assigned
        self.owner = f"intake:{uuid.uuid4().hex[:12]}"
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.waiting = Waiting()  # the chunk each waiting batch waits with, predicted once
        self._next = 0  # index in the intake set where the next tick goes on with the round
        self._round: set[str] = set()  # the batches given a turn in this round (empty: between rounds)

    def waiting_batches(self) -> int:
        """How many batches this replica keeps a waiting chunk for."""
        return len(self.waiting)

    # ------------------------------------------------------------------ one chunk

    def step(self, batch_id: str, token: str, size: int | None = None) -> int:
        """Enqueue the next chunk (``size`` rows, default ``chunk``) of ``batch_id`` under the lease
        ``token``; returns the rows landed (0: the intake is finished or gone; negative: the lease
        or cursor was lost, stop)."""
        try:
            got = self._read(batch_id, size or self.settings.chunk, 0)
        except IntakeLost:
            return 0
        if got is None:
            return 0
        status, done, rows = got
        return self._land(batch_id, token, done, self._prepare(batch_id, status, done, rows))

    def _read(self, batch_id: str, size: int, start: int) -> tuple[str, int, list[dict]] | None:
        """``(status, cursor, rows)``: ``size`` rows from index ``start`` of the intake list (the
        cursor counts the rows landed before it); None when nothing is left to read."""
        q = self.queue
        status, done, total, raw = q.intake_state(batch_id, size, start)
        if status is None or done >= total:  # expired, never was, or finished: nothing to enqueue
            q.forget_intake(batch_id)
            return None
        if not raw:
            if done + start < total:  # the list holds every row not yet landed: it is gone
                self._lost(batch_id, total - done, total)
            return None
        return status, done + start, json.loads("[" + ",".join(raw) + "]")  # one call: faster than one a row

    def _lost(self, batch_id: str, left: int, total: int) -> None:
        """Fail the rows of a batch whose intake list is gone (once: the batch leaves intake)."""
        why = f"intake list lost with {left} of {total} rows not yet enqueued; they were never run"
        lost = self.queue.fail_lost_intake(batch_id, why)
        if lost > 0:
            log.error("batch %s: %s (counted failed)", batch_id, why)
        if lost >= 0:
            raise IntakeLost(why)

    def _prepare(
        self,
        batch_id: str,
        status: str,
        cursor: int,
        rows: list[dict],
        counter: ThreadPoolExecutor | None = None,
        ident: str | None = None,
    ) -> Landing:
        """What the chunk of ``rows`` at ``cursor`` lands; a chunk that waits is kept under ``ident``
        (the batch's ``created_at``; None: not kept) before :class:`IntakeWaits` goes up."""
        if status in STOPPING_BATCH_STATES:
            self.waiting.drop(batch_id)
            return cancelled(batch_id, rows)
        predict, find = self.predict_tokens, self.find_prefixes
        chunk = predict_chunk(cursor, rows, predict, self.count_tokens, counter, find)
        return self._placed(batch_id, chunk, ident)

    def _placed(self, batch_id: str, chunk: Chunk, ident: str | None) -> Landing:
        try:
            assign = partial(self.assign, batch_id=batch_id) if self.assign_takes_batch else self.assign
            placed = place_or_wait(self.queue, batch_id, chunk.loads, assign, self.wait_s)
        except IntakeWaits:
            if ident is not None:
                self.waiting.keep(batch_id, ident, chunk)
            raise
        self.waiting.drop(batch_id)
        order = self.order(chunk.loads) if self.order else None
        charges = charges_of(chunk.loads, placed, order)
        owner = None if self.shared_cache else self.queue.r.hget(keys.batch(batch_id), BATCH_OWNER_FIELD)
        salt = tenant_salt(owner)  # the batch owner's: its hash names it from the transaction creating it
        return landing(batch_id, chunk, placed, order, part=self.settings.land, charges=charges, salt=salt)

    def _land(self, batch_id: str, token: str, cursor: int, out: Landing) -> int:
        """Land ``out`` at ``cursor``, ``land`` rows per script call; the rows landed, or negative
        (lease or cursor lost: the rest is not landed)."""
        s, landed = self.settings, 0
        parts = [out[i : i + s.land] for i in range(0, len(out), s.land)]
        # one round trip; each part is its own script call: a cancel or a lost lease stops the rest
        handled = self.queue.enqueue_parts(batch_id, token, cursor, parts, s.lease_ttl_s)
        for part, n in zip(parts, handled, strict=True):
            if n < 0:
                return n
            landed += n
            self.on_assigned([c for _, _, _, c in part if c])
        return landed

    # ------------------------------------------------------------------ whole batches

    def run_batch(self, batch_id: str, stop: threading.Event | None = None) -> bool:
        """Take the batch's lease and enqueue chunks until its intake is done (True), the lease is
        held elsewhere or lost, the batch waits for a cluster, or ``stop`` is set (False)."""
        return self.turn(batch_id, stop)[0]

    def turn(
        self, batch_id: str, stop: threading.Event | None = None, budget: int | None = None
    ) -> tuple[bool, int]:
        """One turn of the batch: take its lease and enqueue chunks until its intake is done, about
        ``budget`` rows have landed while another batch is in intake (None: no bound), a chunk
        waits for a cluster, the lease is held elsewhere or lost, or ``stop`` is set. Returns
        ``(finished, rows landed)``.

        Pipelined: chunk k lands in a helper thread while chunk k+1 is predicted. Chunk k+1's
        rows are read before chunk k is handed over (so the list's head is where the read
        expects it), and chunk k+1 is handed over only after chunk k landed whole. A batch's
        first chunk is small (``first_chunk``), then sizes double up to ``chunk``.
        """
        s = self.settings
        token = f"{self.owner}:{uuid.uuid4().hex[:8]}"
        if not self.queue.take_intake(batch_id, token, s.lease_ttl_s):
            return False, 0
        landed = 0
        try:
            with (
                ThreadPoolExecutor(1, thread_name_prefix="intake-land") as pool,
                ThreadPoolExecutor(1, thread_name_prefix="intake-count") as counter,
            ):
                try:
                    first = self._first(batch_id, counter)
                except IntakeWaits as e:
                    log.debug("batch %s: intake waits: %s", batch_id, e)
                    return False, 0
                if first is None:
                    return True, 0
                ident, cursor, out = first
                size = min(s.first_chunk, s.chunk) if cursor == 0 else s.chunk
                while True:
                    size = min(2 * size, s.chunk)
                    more = not _stopped(stop) and (
                        budget is None or landed + len(out) < budget or not self._others_wait(batch_id)
                    )
                    after = self._read(batch_id, size, len(out)) if more else None
                    job = pool.submit(self._land, batch_id, token, cursor, out)
                    nxt = None
                    try:
                        if after is not None:
                            nxt = self._prepare(batch_id, after[0], after[1], after[2], counter, ident)
                    except IntakeWaits as e:  # this chunk lands; the next one waits
                        log.debug("batch %s: intake waits: %s", batch_id, e)
                        after, more = None, False
                    n = job.result()
                    if n != len(out):
                        log.warning("batch %s: intake lease or cursor lost (%d); leaving it", batch_id, n)
                        return False, landed
                    landed += n
                    if after is None or nxt is None:
                        return more, landed  # read to the end (finished), or the turn is over
                    if s.pause_s:
                        time.sleep(s.pause_s)
                    cursor, out = after[1], nxt
        finally:
            self.queue.drop_intake(batch_id, token)

    def _first(self, batch_id: str, counter: ThreadPoolExecutor) -> tuple[str, int, Landing] | None:
        """``(the batch's created_at, cursor, what lands)`` of a turn's first chunk: the chunk kept
        while the batch waited if it is still the batch's head (only placed again), else the
        rows read (``first_chunk`` at a batch's start, else ``chunk``) and prepared. None:
        nothing is left to enqueue. Raises :class:`IntakeWaits` while the chunk waits."""
        s = self.settings
        status, done, total, ident = self.queue.intake_head(batch_id)
        if status is not None and done < total and status not in STOPPING_BATCH_STATES:
            kept = self.waiting.get(batch_id, ident, done)
            if kept is not None:
                return ident, done, self._placed(batch_id, kept, ident)
        got = self._read(batch_id, min(s.first_chunk, s.chunk) if done == 0 else s.chunk, 0)
        if got is None:
            self.waiting.drop(batch_id)
            return None
        status, cursor, rows = got
        return ident, cursor, self._prepare(batch_id, status, cursor, rows, counter, ident)

    def _others_wait(self, batch_id: str) -> bool:
        """Whether another batch is in intake (a turn that used its rows then ends)."""
        return any(b != batch_id for b in self.queue.intake_page(0, 2))

    def tick(self, stop: threading.Event | None = None) -> int:
        """Give one turn of about ``turn`` rows to each unfinished intake, oldest first, reading the
        intake set ``page`` ids at a time, so no batch waits for another to finish. A round that
        would give more than ``round_batches`` turns goes on at the next tick. Returns the rows
        landed."""
        s, landed, turns = self.settings, 0, 0
        while True:
            page = self.queue.intake_page(self._next, s.page)
            for batch_id in page:
                if _stopped(stop) or turns >= s.round_batches:
                    return landed  # the round goes on at the next tick, from self._next
                if batch_id in self._round:  # moved down by a batch that left the set
                    self._next += 1
                    continue
                self._round.add(batch_id)
                turns += 1
                finished, n = self._turn(batch_id, stop)
                landed += n
                if not finished:  # a finished batch left the set: the next one took its index
                    self._next += 1
            if len(page) < s.page:
                break
        self.waiting.prune(self._round)  # a kept chunk of a batch no longer in intake goes
        self._next, self._round = 0, set()
        return landed

    def _turn(self, batch_id: str, stop: threading.Event | None) -> tuple[bool, int]:
        try:
            finished, n = self.turn(batch_id, stop, self.settings.turn)
        except IntakeLost:
            return True, 0
        if finished:
            log.info("batch %s: intake finished", batch_id)
        return finished, n

    # ------------------------------------------------------------------ the replica's loop

    def wake(self) -> None:
        """Start on a newly accepted batch now rather than at the next poll (any thread)."""
        if self._wake is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    async def loop(self, stop: asyncio.Event) -> None:
        """Until ``stop``: run :meth:`tick` in a worker thread, again at once while rounds land rows,
        else after a wake-up or ``poll_s``.

        On ``stop`` (or cancellation) the thread finishes the chunk at hand and gives its lease
        back before this returns, so a stopped gateway enqueues nothing afterwards."""
        self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        halt = threading.Event()  # the worker thread's view of ``stop``: it stops after its current chunk
        relay = asyncio.ensure_future(_relay(stop, halt))
        try:
            while not stop.is_set():
                self._wake.clear()
                work = asyncio.ensure_future(asyncio.to_thread(self.tick, halt))
                landed, more = 0, False
                try:
                    landed = await asyncio.shield(work)
                    more = bool(self._round)  # the tick stopped at round_batches: the round goes on
                except asyncio.CancelledError:  # shutting down: let the chunk at hand land, the lease go back
                    halt.set()
                    await asyncio.wait([work], timeout=self.settings.lease_ttl_s)
                    raise
                except Exception:
                    log.exception("intake tick failed")
                if landed or more:  # progress, or a round that goes on: the next tick at once
                    await asyncio.sleep(0)
                    continue
                waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self._wake.wait())]
                try:
                    await asyncio.wait(
                        waits, timeout=self.settings.poll_s, return_when=asyncio.FIRST_COMPLETED
                    )
                finally:
                    for w in waits:
                        w.cancel()
        finally:
            halt.set()
            relay.cancel()


def _stopped(stop: threading.Event | None) -> bool:
    return stop is not None and stop.is_set()


async def _relay(stop: asyncio.Event, halt: threading.Event) -> None:
    await stop.wait()
    halt.set()
