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

from gateway.listing import read_clusters
from gateway.policies import NoClusterError, QueryLoad
from gateway.validation import Checked
from gateway.views import cluster_views
from protos import fleetbatch_pb2 as pb
from workqueue import QueryResult, WorkQueue
from workqueue.keys import gid
from workqueue.records import CANCELLED_BATCH_STATES

log = logging.getLogger(__name__)


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
        )


class EncodedRows(Sequence[str]):
    """The batch's rows as JSON, one per query, encoded when a slice is read (the whole batch is
    never held as JSON at once): what enqueueing needs later, the validated limits and token counts."""

    def __init__(self, request: pb.SubmitBatchRequest, checked: Checked) -> None:
        self.request, self.checked = request, checked

    def __len__(self) -> int:
        return len(self.request.queries)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self._row(k) for k in range(*i.indices(len(self)))]
        return self._row(i if i >= 0 else len(self) + i)

    def _row(self, i: int) -> str:
        q, checked = self.request.queries[i], self.checked
        row = {"id": q.id, "prompt": q.prompt, "max_tokens": checked.max_tokens[i]}
        if i in checked.bad:
            row["bad"] = checked.bad[i]
        else:
            if i in checked.uncounted:  # counted by the intake, which fails it above its cap
                row["token_cap"] = checked.uncounted[i]
            else:
                row["prompt_tokens"] = checked.prompt_tokens[i]
            row["temperature"] = q.sampling.temperature
            row["top_p"] = q.sampling.top_p or 1.0
            if q.sampling.HasField("seed"):
                row["seed"] = q.sampling.seed
            if q.HasField("forced_length"):
                row["forced_length"] = q.forced_length
            if q.metadata:
                row["metadata"] = dict(q.metadata)
        return json.dumps(row, separators=(",", ":"))


def encode_rows(request: pb.SubmitBatchRequest, checked: Checked) -> EncodedRows:
    """One JSON row per query (see :class:`EncodedRows`)."""
    return EncodedRows(request, checked)


def payload(batch_id: str, row: dict, predicted: float) -> str:
    """The query's payload JSON, field for field ``asdict(QueuedQuery(...))`` (built directly: asdict's
    deep copies cost more than the rest of a chunk's bookkeeping)."""
    return json.dumps(
        {
            "batch_id": batch_id,
            "query_id": row["id"],
            "prompt": row["prompt"],
            "max_tokens": row["max_tokens"],
            "prompt_tokens": row["prompt_tokens"],
            "predicted_tokens": predicted,
            "temperature": row["temperature"],
            "top_p": row["top_p"],
            "seed": row.get("seed"),
            "forced_length": row.get("forced_length"),
            "metadata": row.get("metadata", {}),
        }
    )


def _failed(batch_id: str, query_id: str, why: str) -> str:
    """The result JSON of a query failed at intake (``why`` in its ``error``)."""
    return QueryResult(batch_id, query_id, finish_reason="error", error=why).to_json()


class Intake:
    """Runs the background intake of one gateway replica (see the module docstring)."""

    def __init__(
        self,
        queue: WorkQueue,
        predict_tokens: Callable[[list[str]], list[float]],
        assign: Callable[[Sequence[QueryLoad], list], list[str]],
        settings: IntakeSettings,
        on_assigned: Callable[[list[str]], None] = lambda names: None,
        count_tokens: Callable[[list[str]], list[int]] | None = None,
    ) -> None:
        self.queue = queue
        self.count_tokens = count_tokens
        self.predict_tokens = predict_tokens
        self.assign = assign
        self.settings = settings
        self.on_assigned = on_assigned
        self.owner = f"intake:{uuid.uuid4().hex[:12]}"
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # ------------------------------------------------------------------ one chunk

    def step(self, batch_id: str, token: str, size: int | None = None) -> int:
        """Enqueue the next chunk (``size`` rows, default ``chunk``) of ``batch_id`` under the lease
        ``token``; returns the rows landed (0: the intake is finished or gone; negative: the lease
        or cursor was lost, stop)."""
        got = self._read(batch_id, size or self.settings.chunk, 0)
        if got is None:
            return 0
        status, done, rows = got
        return self._land(batch_id, token, done, self._prepare(batch_id, status, rows))

    def _read(self, batch_id: str, size: int, start: int) -> tuple[str, int, list[dict]] | None:
        """``(status, cursor, rows)``: ``size`` rows from index ``start`` of the intake list (the
        cursor counts the rows landed before it); None when nothing is left to read."""
        q = self.queue
        status, done, total, raw = q.intake_state(batch_id, size, start)
        if status is None or done >= total:  # expired, never was, or finished: nothing to enqueue
            q.forget_intake(batch_id)
            return None
        if not raw:
            if done + start < total:
                log.error("batch %s: intake list lost with %d of %d rows left", batch_id, total - done, total)
            return None
        return status, done + start, [json.loads(r) for r in raw]

    def _prepare(
        self, batch_id: str, status: str, rows: list[dict], counter: ThreadPoolExecutor | None = None
    ) -> list[tuple[str, str, float, str]]:
        if status in CANCELLED_BATCH_STATES:
            return [(gid(batch_id, r["id"]), "", 0.0, "") for r in rows]
        return self._assigned(batch_id, rows, counter)

    def _land(self, batch_id: str, token: str, cursor: int, out: list[tuple[str, str, float, str]]) -> int:
        """Land ``out`` at ``cursor``, ``land`` rows per script call; the rows landed, or negative
        (lease or cursor lost: the rest is not landed)."""
        s, landed = self.settings, 0
        for i in range(0, len(out), s.land):  # each part lands alone: a cancel or a lost lease stops the rest
            part = out[i : i + s.land]
            n = self.queue.enqueue_chunk(batch_id, token, cursor + landed, part, s.lease_ttl_s)
            if n < 0:
                return n
            landed += n
            self.on_assigned([c for _, _, _, c in part if c])
        return landed

    def _count(self, rows: list[dict]) -> None:
        """Count the tokens of rows staged uncounted (``token_cap``); one above its cap turns bad."""
        todo = [r for r in rows if "prompt_tokens" not in r and "bad" not in r]
        if not todo:
            return
        if self.count_tokens is None:
            raise RuntimeError("rows staged without token counts need an intake with count_tokens")
        for r, n in zip(todo, self.count_tokens([r["prompt"] for r in todo]), strict=True):
            r["prompt_tokens"] = n
            if n > r["token_cap"]:  # the bound is an upper bound: this is a guard, not a path
                r["bad"] = f"prompt has {n} tokens; its limit is {r['token_cap']}"

    def _assigned(
        self, batch_id: str, rows: list[dict], counter: ThreadPoolExecutor | None = None
    ) -> list[tuple[str, str, float, str]]:
        fresh = [r for r in rows if "bad" not in r]
        counting = (
            counter.submit(self._count, rows) if counter else None
        )  # the tokenizer beside the predictor
        if counting is None:
            self._count(rows)
        predicted = self.predict_tokens([r["prompt"] for r in fresh]) if fresh else []
        if counting is not None:
            counting.result()
        good = [r for r in rows if "bad" not in r]
        if len(good) != len(fresh):
            predicted = [p for r, p in zip(fresh, predicted, strict=True) if "bad" not in r]
        loads = [
            QueryLoad(r["id"], r["prompt_tokens"], float(min(p, r["max_tokens"])))
            for r, p in zip(good, predicted, strict=True)
        ]
        names = self._names(loads) if loads else []
        where = {load.key: (load, c) for load, c in zip(loads, names, strict=True)}
        out = []
        for r in rows:
            g = gid(batch_id, r["id"])
            if "bad" in r:
                out.append((g, _failed(batch_id, r["id"], f"invalid query: {r['bad']}"), 0.0, ""))
                continue
            load, c = where[r["id"]]
            if c is None:
                out.append(
                    (g, _failed(batch_id, r["id"], "no accepting cluster can take this query"), 0.0, "")
                )
                continue
            out.append((g, payload(batch_id, r, load.predicted_tokens), load.total_tokens, c))
        return out

    def _names(self, loads: list[QueryLoad]) -> list[str | None]:
        """Assign the chunk; if one query fits nowhere, assign one by one and leave the misfits None.
        Raises :class:`NoClusterError` while no cluster accepts work at all (the chunk waits)."""
        views = cluster_views(read_clusters(self.queue))
        try:
            return list(self.assign(loads, views))
        except NoClusterError:
            if not any(v.usable for v in views):
                raise
        names: list[str | None] = []
        for load in loads:
            try:
                names.append(self.assign([load], views)[0])
            except NoClusterError as e:
                log.warning("%s", e)
                names.append(None)
        return names

    # ------------------------------------------------------------------ whole batches

    def run_batch(self, batch_id: str, stop: threading.Event | None = None) -> bool:
        """Take the batch's lease and enqueue chunks until its intake is done (True), the lease is
        held elsewhere or lost, or ``stop`` is set (False).

        Pipelined: chunk k lands in a helper thread while chunk k+1 is predicted. Chunk k+1's
        rows are read before chunk k is handed over (so the list's head is where the read
        expects it), and chunk k+1 is handed over only after chunk k landed whole.
        """
        s = self.settings
        token = f"{self.owner}:{uuid.uuid4().hex[:8]}"
        if not self.queue.take_intake(batch_id, token, s.lease_ttl_s):
            return False
        size = min(s.first_chunk, s.chunk)
        try:
            got = self._read(batch_id, size, 0)
            if got is None:
                return True
            with (
                ThreadPoolExecutor(1, thread_name_prefix="intake-land") as pool,
                ThreadPoolExecutor(1, thread_name_prefix="intake-count") as counter,
            ):
                status, cursor, rows = got
                out = self._prepare(batch_id, status, rows, counter)
                while True:
                    size = min(2 * size, s.chunk)
                    after = None if _stopped(stop) else self._read(batch_id, size, len(out))
                    landing = pool.submit(self._land, batch_id, token, cursor, out)
                    nxt = self._prepare(batch_id, after[0], after[2], counter) if after is not None else None
                    n = landing.result()
                    if n != len(out):
                        log.warning("batch %s: intake lease or cursor lost (%d); leaving it", batch_id, n)
                        return False
                    if after is None:
                        return not _stopped(stop)
                    if s.pause_s:
                        time.sleep(s.pause_s)
                    cursor, out = after[1], nxt
        finally:
            self.queue.drop_intake(batch_id, token)

    def tick(self, stop: threading.Event | None = None) -> int:
        """One pass over the unfinished intakes; returns how many this replica finished."""
        finished = 0
        for batch_id in self.queue.intake_batches():
            if stop is not None and stop.is_set():
                break
            try:
                t0 = time.perf_counter()
                if self.run_batch(batch_id, stop):
                    finished += 1
                    log.info("batch %s: intake finished (%.2f s here)", batch_id, time.perf_counter() - t0)
            except NoClusterError as e:
                log.warning("batch %s: intake waits: %s", batch_id, e)
        return finished

    # ------------------------------------------------------------------ the replica's loop

    def wake(self) -> None:
        """Start on a newly accepted batch now rather than at the next poll (any thread)."""
        if self._wake is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    async def loop(self, stop: asyncio.Event) -> None:
        """Until ``stop``: run :meth:`tick` in a worker thread, then wait for a wake-up or ``poll_s``.

        On ``stop`` (or cancellation) the thread finishes the chunk at hand and gives its lease
        back before this returns, so a stopped gateway enqueues nothing afterwards."""
        self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        halt = threading.Event()  # the worker thread's view of ``stop``: it stops after its current chunk
        relay = asyncio.ensure_future(_relay(stop, halt))
        try:
            while not stop.is_set():
                self._wake.clear()
                work = asyncio.ensure_future(asyncio.to_thread(self.tick, halt))
                try:
                    await asyncio.shield(work)
                except asyncio.CancelledError:  # shutting down: let the chunk at hand land, the lease go back
                    halt.set()
                    await asyncio.wait([work], timeout=self.settings.lease_ttl_s)
                    raise
                except Exception:
                    log.exception("intake tick failed")
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
