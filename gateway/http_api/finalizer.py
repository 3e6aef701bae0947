"""The finalizer of HTTP batches: output and error files, usage, retention.

Every gateway with the HTTP front runs :meth:`Finalizer.tick` every 0.5 s. It works from Redis
(the set ``{fb}:oai:finalize`` of batches not yet finalized), so a restarted gateway finishes
what a dead one left; a lease per batch keeps two gateways from writing the same files at once
(``LEASE_S``, renewed as the writer goes, so a gateway killed mid-write holds the batch up that
long at most; its token names the holder, ``host:pid:...``; a writer that finds its lease taken
stops), and file ids are derived from the batch id, so writing again after a crash replaces the
half-written file. On its pass it also records when a batch became ``in_progress``
(:func:`gateway.http_api.batches.note_progress`), sums the batch's token ``usage`` while it writes
the output file, and then applies the retention of :mod:`gateway.http_api.retention` (the record
expires with the gateway batch; expired batches leave the list and their files are deleted).

One batch that cannot be finalized (its input file gone, a full disk, an NFS hiccup) holds up no
other, and is retried until it succeeds: each failed pass is logged, counted in the record
(``finalize_failures``) and in the metrics, and the next try waits an exponential backoff
(:func:`retry_delay`: 0.5 s doubling to 5 minutes; ``finalize_retry_at`` in the record, so every
gateway replica keeps it). Only when the next try would come after the batch's retention ends
(the gateway batch's TTL in Redis: its results expire with it) is the batch ``failed``, its
message in ``finalize_error``, and out of the pending set.

Which file a result's line goes to is :func:`workqueue.outcome`'s answer (through
:func:`gateway.http_api.format.output_line`); a file is written when it has lines, so no row is in
neither file whatever the batch's counters say.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from gateway.http_api.batches import PENDING, names_of, note_progress, record_key, set_record_once
from gateway.http_api.files import FileStore, read_lines
from gateway.http_api.format import CHAT, output_line
from gateway.http_api.retention import expire_orphan, retire, sweep
from gateway.status.metrics import GatewayMetrics
from workqueue import BatchInfo, WorkQueue, keys
from workqueue.lease import Lease

log = logging.getLogger(__name__)

ORPHAN_S = 600.0  # a record whose gateway batch never appeared within this long is dropped
#: the finalizer's lease on a batch (renewed every ``RESULT_CHUNK`` rows written); env FLEETBATCH_FINALIZE_LEASE_S
LEASE_S = 30.0
RESULT_CHUNK = 1000
RETRY_FIRST_S = 0.5  # wait after a batch's first failed pass; doubles with each failure
RETRY_MAX_S = 300.0  # the longest wait between two tries
# KEYS: a record. ARGV: when the next try may come, the count the pass read before it failed. Counts a failure
# and keeps the time of the next try, unless the record is gone (never recreates it); returns the count. Only
# the count read moves on: the same call resent (its reply lost) finds it counted and counts nothing more.
COUNT_FAILURE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local seen = tonumber(redis.call('HGET', KEYS[1], 'finalize_failures') or '0')
if seen ~= tonumber(ARGV[2]) then return seen end
redis.call('HSET', KEYS[1], 'finalize_retry_at', ARGV[1])
return redis.call('HINCRBY', KEYS[1], 'finalize_failures', 1)
"""


class LeaseLost(RuntimeError):
    """The finalizer's lease on a batch lapsed while it wrote the files (a stall past ``lease_s``)."""


def holder_token() -> str:
    """A finalizer lease's token: this gateway's host and process, then a random part."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(6)}"


def retry_delay(failures: int) -> float:
    """Seconds to wait after the ``failures``-th failed pass on a batch: exponential, capped."""
    return min(RETRY_MAX_S, RETRY_FIRST_S * 2.0 ** max(0, failures - 1))


def file_id_of(batch_id: str, kind: str) -> str:
    return "file-" + hashlib.sha256(f"{batch_id}\0{kind}".encode()).hexdigest()[:24]


@dataclass
class Finalizer:
    """Writes the output and error files of finished HTTP batches, then marks them finalized.

    ``retention_s`` (the gateway's) is for records whose gateway batch is gone; the others
    follow their gateway batch's TTL.
    """

    queue: WorkQueue
    store: FileStore
    retention_s: float = 0.0
    lease_s: float = field(
        default_factory=lambda: float(os.environ.get("FLEETBATCH_FINALIZE_LEASE_S") or LEASE_S)
    )
    metrics: GatewayMetrics | None = None
    clock: Callable[[], float] = time.time  # when retries are due (tests inject one)

    def tick(self) -> int:
        """Finalize every pending batch that is final (and not waiting for a retry), then expire
        what is due; returns how many were finalized. A batch that fails is logged and counted
        (:meth:`failed`) and the pass goes on; the sweep runs whatever the batches did."""
        done = retrying = 0
        try:
            for batch_id in sorted(self.queue.r.smembers(PENDING)):
                try:
                    done += self.finalize(batch_id)
                except Exception as e:
                    self.failed(batch_id, e)
                retrying += self._waiting(self.queue.r.hget(record_key(batch_id), "finalize_retry_at"))
        finally:
            sweep(self.queue, self.store)
            if self.metrics is not None:
                self.metrics.finalize_retrying.set(retrying)
        return done

    def _waiting(self, retry_at: str | None) -> bool:
        return bool(retry_at) and float(retry_at) > self.clock()

    def failed(self, batch_id: str, error: Exception) -> None:
        """Count a failed pass on the batch and schedule its next try (:func:`retry_delay`); when that
        would come after the batch's retention ends, mark it failed (``finalize_error``), out of the
        pending set, retained as a finalized batch."""
        r, key = self.queue.r, record_key(batch_id)
        try:
            if self.metrics is not None:
                self.metrics.finalize_failures.inc()
            failures = int(r.hget(key, "finalize_failures") or 0) + 1
            delay = retry_delay(failures)
            left_ms = int(r.pttl(keys.batch(batch_id)))  # -1: kept forever, -2: expired already
            if left_ms == -1 or left_ms > delay * 1000:
                if int(r.eval(COUNT_FAILURE, 1, key, self.clock() + delay, failures - 1)):
                    log.warning(
                        "batch %s: cannot write its output files (failed pass %d): %r; retrying in %.1f s",
                        batch_id,
                        failures,
                        error,
                        delay,
                    )
                return
            r.eval(COUNT_FAILURE, 1, key, 0, failures - 1)
            message = f"the output files could not be written: {type(error).__name__}: {error}"
            if set_record_once(r, batch_id, "finalize_error", message) is None:
                return  # the record expired meanwhile
            rec = r.hgetall(key)
            for kind in ("output", "errors"):  # what a failed pass may have left
                self.store.delete(file_id_of(batch_id, kind))
            pipe = r.pipeline(transaction=True)
            pipe.hset(key, mapping={"finalized_at": time.time(), "output_file_id": "", "error_file_id": ""})
            pipe.srem(PENDING, batch_id)
            retire(self.queue, batch_id, [rec.get("input_file_id", "")], self.retention_s, pipe)
            pipe.execute()
            if self.metrics is not None:
                self.metrics.finalize_gave_up.inc()
            log.error(
                "batch %s: failed after %d passes, its retention ends before the next: %s",
                batch_id,
                failures,
                message,
            )
        except Exception:
            log.exception("batch %s: cannot record the failure to finalize it", batch_id)

    def finalize(self, batch_id: str) -> bool:
        r, key = self.queue.r, record_key(batch_id)
        rec = r.hgetall(key)
        info = self.queue.batch(batch_id)
        if not rec:
            r.srem(PENDING, batch_id)
            return False
        if info is None:
            if time.time() - float(rec.get("created_at") or 0) > ORPHAN_S:
                expire_orphan(self.queue, batch_id, self.retention_s)
            return False
        note_progress(self.queue, batch_id, info, rec)
        if not info.final or self._waiting(rec.get("finalize_retry_at")):
            return False
        lease = Lease(r, keys.oai_finalize_lease(batch_id), holder_token(), self.lease_s)
        if not lease.acquire():
            return False  # another gateway writes them
        try:
            r.hsetnx(key, "finalizing_at", time.time())
            fields = self._write(batch_id, info, rec, lease)
            if not lease.renew():
                raise LeaseLost(f"batch {batch_id}: the finalizer's lease lapsed; another gateway writes it")
            fields["finalized_at"] = time.time()
            files = [str(fields["output_file_id"]), str(fields["error_file_id"]), rec["input_file_id"]]
            pipe = r.pipeline(transaction=True)
            pipe.hset(key, mapping=fields)
            pipe.srem(PENDING, batch_id)
            retire(self.queue, batch_id, files, self.retention_s, pipe)
            pipe.execute()
            failures = int(rec.get("finalize_failures") or 0)
            log.info(
                "batch %s: %s, output files written%s",
                batch_id,
                info.status,
                f" after {failures} failed passes" if failures else "",
            )
            return True
        finally:
            lease.release()

    def _write(self, batch_id: str, info: BatchInfo, rec: dict, lease: Lease) -> dict[str, str | int | float]:
        names = names_of(read_lines(self.store, rec["input_file_id"]))
        endpoint = rec.get("endpoint", CHAT)
        usage = [0, 0]
        fields: dict[str, str | int | float] = {"output_file_id": "", "error_file_id": ""}
        unrun = info.error or "the request has no result: it was never run"
        for kind, want_error in (("output", False), ("errors", True)):
            file_id = file_id_of(batch_id, kind)
            counted = [0]
            lines = self._lines(batch_id, endpoint, names, want_error, usage, counted, unrun, lease)
            self.store.put(file_id, f"{batch_id}_{kind}.jsonl", "batch_output", lines)
            if counted[0]:
                fields["error_file_id" if want_error else "output_file_id"] = file_id
            else:  # no line of this kind: no file
                self.store.delete(file_id)
        fields["input_tokens"], fields["output_tokens"] = usage
        return fields

    def _lines(
        self,
        batch_id: str,
        endpoint: str,
        names: dict,
        want_error: bool,
        usage: list[int],
        counted: list[int],
        unrun: str,
        lease: Lease,
    ) -> Iterator[bytes]:
        """The file's lines in chunks; adds the output lines' prompt and completion tokens to ``usage``
        and the lines to ``counted``. Every request of the input has exactly one line in one of the
        two files: a result seen twice is written once, and the error file ends with a line (error
        ``unrun``) for each request that has no result at all (rows whose intake was lost)."""
        start, seen = 0, set()
        while True:
            if not lease.renew():  # a pass that stalled past its lease: another gateway may write now
                raise LeaseLost(f"batch {batch_id}: the finalizer's lease lapsed while writing; stopped")
            rows = self.queue.results(batch_id, start, start + RESULT_CHUNK - 1)
            if not rows:
                break
            start += len(rows)
            out = []
            for row in rows:
                qid = str(row.get("query_id", ""))
                if qid in seen:
                    continue
                seen.add(qid)
                custom_id, model = names.get(qid, (qid, ""))
                line = output_line(row, endpoint, model, custom_id)
                if (line["error"] is not None) != want_error:
                    continue
                if line["response"] is not None:
                    u = line["response"]["body"]["usage"]
                    usage[0] += u["prompt_tokens"]
                    usage[1] += u["completion_tokens"]
                out.append(json.dumps(line, ensure_ascii=False) + "\n")
            counted[0] += len(out)
            yield "".join(out).encode()
        if want_error:
            out = [
                json.dumps(output_line(_unrun(batch_id, q, unrun), endpoint, "", c), ensure_ascii=False)
                + "\n"
                for q, (c, _) in names.items()
                if q not in seen
            ]
            counted[0] += len(out)
            yield "".join(out).encode()


def _unrun(batch_id: str, query_id: str, error: str) -> dict:
    """The result a request that never ran stands for in the error file."""
    return {"batch_id": batch_id, "query_id": query_id, "finish_reason": "error", "error": error}
