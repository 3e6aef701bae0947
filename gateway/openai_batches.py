"""OpenAI batches on top of the gateway's batches: input files to queries, states, output files.

A batch created over HTTP (``POST /v1/batches``) is an ordinary gateway batch (the same id,
visible to gRPC ``GetBatch``) plus a small Redis record ``{fb}:oai:b:<id>`` holding what OpenAI's
batch object needs and the queue does not know: ``input_file_id``, ``endpoint``,
``completion_window``, the finalizing / cancelling times, ``output_file_id`` and ``error_file_id``.

**States.** ``validating`` and ``in_progress`` are the gateway's own; once the gateway batch is
final the OpenAI batch is ``finalizing`` (``cancelling`` for a cancelled one) until the
:class:`Finalizer` has written its output and error files, then ``completed``, ``failed`` (every
request failed) or ``cancelled``. The finalizer works from Redis (the set ``{fb}:oai:finalize``
of batches not yet finalized), so a restarted gateway finishes what a dead one left; a lease per
batch keeps two gateways from writing the same files at once, and file ids are derived from the
batch id, so writing again after a crash replaces the half-written file.

**Query ids.** When every ``custom_id`` is a valid query id (``[A-Za-z0-9_.-]{1,128}``) it is the
query id; otherwise every query is named ``line-<n>`` (its line in the input file) and the
output names each by its ``custom_id``, read back from the input file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from gateway.openai_files import FileStore, read_lines
from gateway.openai_format import CHAT, output_line, parse_row
from gateway.validation import ID_RE
from protos import fleetbatch_pb2 as pb
from workqueue import BatchInfo, WorkQueue
from workqueue.keys import PREFIX

log = logging.getLogger(__name__)

LIST = PREFIX + "oai:batches"  # ZSET: ids of batches created over HTTP, by creation time
PENDING = PREFIX + "oai:finalize"  # SET: ids whose output files are not written yet
WINDOW_S = 24 * 3600
ORPHAN_S = 600.0  # a record whose gateway batch never appeared within this long is dropped
RESULT_CHUNK = 1000
RELEASE = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"


def record_key(batch_id: str) -> str:
    return f"{PREFIX}oai:b:{batch_id}"


def new_batch_id() -> str:
    return "batch_" + secrets.token_hex(12)


class BadInput(ValueError):
    """Input the front refuses (400), naming the request field at fault."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def _rows(lines: Iterable[bytes]) -> Iterator[tuple[int, dict]]:
    """``(line number, parsed JSON)`` of each non-empty line."""
    for n, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            yield n, json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise BadInput(f"input file line {n}: not valid JSON ({e})", "input_file_id") from None


def query_ids(custom_ids: list[str], lines: list[int]) -> tuple[list[str], bool]:
    """The query id of each request; True when they are ``line-<n>`` (some custom_id is not an id)."""
    if all(ID_RE.match(c) for c in custom_ids):
        return custom_ids, False
    return [f"line-{n}" for n in lines], True


def build_request(
    lines: Iterable[bytes], endpoint: str, tokenizer, batch_id: str, metadata: dict[str, str]
) -> pb.SubmitBatchRequest:
    """The gateway submission of an input file; :class:`BadInput` naming the line and field otherwise."""
    reqs, numbers, seen = [], [], {}
    for n, row in _rows(lines):
        try:
            r = parse_row(row, 0, tokenizer, endpoint)
        except ValueError as e:
            raise BadInput(f"input file line {n}: {e}", "input_file_id") from None
        if r.custom_id in seen:
            raise BadInput(
                f"input file line {n}: custom_id {r.custom_id!r} appears twice (also line {seen[r.custom_id]})",
                "input_file_id",
            )
        seen[r.custom_id] = n
        reqs.append(r)
        numbers.append(n)
    if not reqs:
        raise BadInput("the input file holds no requests", "input_file_id")
    ids, _ = query_ids([r.custom_id for r in reqs], numbers)
    req = pb.SubmitBatchRequest(batch_id=batch_id, metadata=metadata)
    for qid, r in zip(ids, reqs, strict=True):
        q = req.queries.add(id=qid, prompt=r.prompt, max_tokens=r.max_tokens)
        q.sampling.temperature = r.temperature
        q.sampling.top_p = r.top_p
        if r.seed is not None:
            q.sampling.seed = r.seed
    return req


def names_of(lines: Iterable[bytes]) -> dict[str, tuple[str, str]]:
    """``query id -> (custom_id, model)`` of an input file (as :func:`build_request` named them)."""
    custom, models, numbers = [], [], []
    for n, row in _rows(lines):
        body = row.get("body") if isinstance(row.get("body"), dict) else {}
        custom.append(str(row.get("custom_id")))
        models.append(str(body.get("model") or ""))
        numbers.append(n)
    ids, _ = query_ids(custom, numbers)
    return {q: (c, m) for q, c, m in zip(ids, custom, models, strict=True)}


def create_record(queue: WorkQueue, batch_id: str, input_file_id: str, endpoint: str, window: str) -> None:
    now = time.time()
    pipe = queue.r.pipeline(transaction=True)
    pipe.hset(
        record_key(batch_id),
        mapping={
            "input_file_id": input_file_id,
            "endpoint": endpoint,
            "completion_window": window,
            "created_at": now,
        },
    )
    pipe.zadd(LIST, {batch_id: now})
    pipe.sadd(PENDING, batch_id)
    pipe.execute()


def drop_record(queue: WorkQueue, batch_id: str) -> None:
    pipe = queue.r.pipeline(transaction=True)
    pipe.delete(record_key(batch_id))
    pipe.zrem(LIST, batch_id)
    pipe.srem(PENDING, batch_id)
    pipe.execute()


def _ts(value) -> int | None:
    return int(float(value)) if value not in (None, "", "0") else None


def openai_status(info: BatchInfo | None, rec: dict) -> str:
    if info is None:
        return "expired" if rec else "failed"
    if not info.final:
        return info.status  # validating | in_progress | cancelling
    if rec and not rec.get("finalized_at"):
        return "cancelling" if info.status == "cancelled" else "finalizing"
    return info.status  # completed | failed | cancelled


def batch_object(batch_id: str, info: BatchInfo | None, rec: dict) -> dict:
    """OpenAI's batch object for a gateway batch (``info``) and its HTTP record (``rec``, maybe empty)."""
    status = openai_status(info, rec)
    created = _ts(rec.get("created_at")) or (int(info.created_at) if info else 0)
    done = _ts(rec.get("finalized_at")) or (int(info.completed_at) if info and info.completed_at else None)
    failed = (info.failed + info.cancelled) if info else 0
    errors = None
    if status == "failed":
        message = "every request failed; see error_file_id" if info else "the batch was not created"
        errors = {
            "object": "list",
            "data": [{"code": "failed", "message": message, "param": None, "line": None}],
        }
    return {
        "id": batch_id,
        "object": "batch",
        "endpoint": rec.get("endpoint", CHAT),
        "errors": errors,
        "input_file_id": rec.get("input_file_id", ""),
        "completion_window": rec.get("completion_window", "24h"),
        "status": status,
        "output_file_id": rec.get("output_file_id") or None,
        "error_file_id": rec.get("error_file_id") or None,
        "created_at": created,
        "in_progress_at": created if status not in ("validating", "failed") else None,
        "expires_at": created + WINDOW_S,
        "finalizing_at": _ts(rec.get("finalizing_at")),
        "completed_at": done if status == "completed" else None,
        "failed_at": done if status == "failed" else None,
        "expired_at": _ts(rec.get("expired_at")),
        "cancelling_at": _ts(rec.get("cancelling_at")),
        "cancelled_at": done if status == "cancelled" else None,
        "request_counts": {
            "total": info.total if info else 0,
            "completed": info.completed if info else 0,
            "failed": failed,
        },
        "metadata": (info.metadata if info else None) or None,
    }


def file_id_of(batch_id: str, kind: str) -> str:
    return "file-" + hashlib.sha256(f"{batch_id}\0{kind}".encode()).hexdigest()[:24]


@dataclass
class Finalizer:
    """Writes the output and error files of finished HTTP batches, then marks them finalized."""

    queue: WorkQueue
    store: FileStore
    retention_s: float = 0.0
    lease_s: float = 300.0

    def tick(self) -> int:
        """Finalize every pending batch that is final; returns how many were finalized."""
        done = 0
        for batch_id in sorted(self.queue.r.smembers(PENDING)):
            try:
                done += self.finalize(batch_id)
            except FileNotFoundError as e:
                log.warning("batch %s: cannot write its output files: %s", batch_id, e)
        return done

    def finalize(self, batch_id: str) -> bool:
        r, key = self.queue.r, record_key(batch_id)
        rec = r.hgetall(key)
        info = self.queue.batch(batch_id)
        if not rec:
            r.srem(PENDING, batch_id)
            return False
        if info is None:
            if time.time() - float(rec.get("created_at") or 0) > ORPHAN_S:
                r.hset(key, "expired_at", time.time())
                r.srem(PENDING, batch_id)
            return False
        if not info.final:
            return False
        lease, token = key + ":lease", secrets.token_hex(8)
        if not r.set(lease, token, nx=True, px=int(self.lease_s * 1000)):
            return False  # another gateway writes them
        try:
            r.hsetnx(key, "finalizing_at", time.time())
            fields = self._write(batch_id, info, rec)
            fields["finalized_at"] = time.time()
            pipe = r.pipeline(transaction=True)
            pipe.hset(key, mapping=fields)
            pipe.srem(PENDING, batch_id)
            if self.retention_s > 0:
                pipe.expire(key, int(self.retention_s))
            pipe.execute()
            log.info("batch %s: %s, output files written", batch_id, info.status)
            return True
        finally:
            r.eval(RELEASE, 1, lease, token)

    def _write(self, batch_id: str, info: BatchInfo, rec: dict) -> dict[str, str]:
        names = names_of(read_lines(self.store, rec["input_file_id"]))
        endpoint = rec.get("endpoint", CHAT)
        fields = {"output_file_id": "", "error_file_id": ""}
        for kind, want_error, count in (
            ("output", False, info.completed),
            ("errors", True, info.failed + info.cancelled),
        ):
            if count <= 0:
                continue
            file_id = file_id_of(batch_id, kind)
            lines = self._lines(batch_id, endpoint, names, want_error)
            self.store.put(file_id, f"{batch_id}_{kind}.jsonl", "batch_output", lines)
            fields["error_file_id" if want_error else "output_file_id"] = file_id
        return fields

    def _lines(self, batch_id: str, endpoint: str, names: dict, want_error: bool) -> Iterator[bytes]:
        start = 0
        while True:
            rows = self.queue.results(batch_id, start, start + RESULT_CHUNK - 1)
            if not rows:
                return
            start += len(rows)
            out = []
            for row in rows:
                custom_id, model = names.get(row.get("query_id", ""), (row.get("query_id", ""), ""))
                line = output_line(row, endpoint, model or "fleetbatch", custom_id)
                if (line["error"] is not None) == want_error:
                    out.append(json.dumps(line, ensure_ascii=False) + "\n")
            yield "".join(out).encode()


def list_batches(queue: WorkQueue, limit: int, after: str | None) -> tuple[list[str], bool]:
    """Ids of HTTP batches, newest first, after the id ``after``; and whether more follow."""
    start = 0
    if after:
        rank = queue.r.zrevrank(LIST, after)
        if rank is None:
            raise BadInput(f"after={after!r} is not a batch of this list", "after")
        start = rank + 1
    ids = queue.r.zrevrange(LIST, start, start + limit)
    pipe = queue.r.pipeline(transaction=False)
    for b in ids:
        pipe.exists(record_key(b))
    alive = pipe.execute()
    gone = [b for b, ok in zip(ids, alive, strict=True) if not ok]
    if gone:
        queue.r.zrem(LIST, *gone)
    ids = [b for b, ok in zip(ids, alive, strict=True) if ok]
    return ids[:limit], len(ids) > limit
