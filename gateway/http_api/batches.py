"""OpenAI batches on top of the gateway's batches: input files to queries, states, output files.

A batch created over HTTP (``POST /v1/batches``) is an ordinary gateway batch (the same id,
visible to gRPC ``GetBatch``) plus a small Redis record ``{fb}:oai:b:<id>`` holding what OpenAI's
batch object needs and the queue does not know: ``input_file_id``, ``endpoint``,
``completion_window``, the in-progress / finalizing / cancelling times, ``output_file_id``,
``error_file_id`` and the token ``usage``.

**States.** ``validating`` and ``in_progress`` are the gateway's own; once the gateway batch is
final the OpenAI batch is ``finalizing`` (``cancelling`` for a cancelled one) until the
finalizer (:mod:`gateway.http_api.finalizer`) has written its output and error files, then
``completed``, ``failed`` (every request failed, or the finalizer could not write the files:
``finalize_error``) or ``cancelled``. A batch whose input file is invalid is created, then
``failed`` at once, as OpenAI's are: ``errors`` lists each bad line (``invalid``), and no gateway
batch exists (nothing is enqueued). A record without its gateway batch is ``validating`` while
the batch is being created and ``expired`` once the finalizer marks it so. ``in_progress_at`` is when
the batch became ``in_progress`` (:func:`note_progress`).

**Query ids.** When every ``custom_id`` is a valid query id (``[A-Za-z0-9_.-]{1,128}``) it is the
query id; otherwise every query is named ``line-<n>`` (its line in the input file) and the
output names each by its ``custom_id``, read back from the input file.
"""

from __future__ import annotations

import json
import secrets
import time
from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from gateway.batches.quota import OWNER_FIELD, owner_allows
from gateway.checks.validation import ID_RE, Limits, query_problems
from gateway.http_api.format import ChatTemplate, OpenAIRequest, parse_row
from gateway.http_api.objects import batch_object
from gateway.status.eta import Eta
from protos import fleetbatch_pb2 as pb
from workqueue import BatchInfo, BatchState, WorkQueue, keys
from workqueue.batches import batch_info
from workqueue.set_once import set_once

LIST = keys.OAI_BATCHES  # ZSET: ids of batches created over HTTP, by creation time
PENDING = keys.OAI_FINALIZE  # SET: ids whose output files are not written yet
MAX_ERRORS = 100  # lines an invalid input file's ``errors`` list (the rest are counted)
PART_BYTES = 4 << 20  # input bytes of one message of a streamed submission (:func:`request_parts`)
HELD_BYTES = 4 * PART_BYTES  # what a streamed creation holds at most, counted in --max-inflight-mb


def record_key(batch_id: str) -> str:
    return keys.oai_record(batch_id)


def set_record_once(r, batch_id: str, field: str, value: str | float) -> str | None:
    """:func:`workqueue.set_once.set_once` on the batch's record (there while it has ``created_at``)."""
    return set_once(r, record_key(batch_id), field, value, present="created_at")


def new_batch_id() -> str:
    return "batch_" + secrets.token_hex(12)


class BadInput(ValueError):
    """Input the front refuses (400), naming the request field at fault."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class LineError:
    """One entry of OpenAI's batch ``errors``: the input file's ``line`` (1-based; None for the file)."""

    message: str
    line: int | None = None
    code: str = "invalid_request"

    def as_json(self) -> dict:
        return {"code": self.code, "message": self.message, "param": None, "line": self.line}


class InvalidFile(ValueError):
    """An input file the batch fails on (``failed`` with ``errors``; nothing enqueued)."""

    def __init__(self, errors: list[LineError]):
        super().__init__("; ".join(e.message for e in errors[:3]))
        self.errors = errors


def _rows(lines: Iterable[bytes]) -> Iterator[tuple[int, dict]]:
    """``(line number, parsed JSON)`` of each non-empty line."""
    for n, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            yield n, json.loads(raw)
        except (ValueError, RecursionError) as e:  # RecursionError: nesting too deep
            raise BadInput(f"input file line {n}: not valid JSON ({e})", "input_file_id") from None


def query_ids(custom_ids: list[str], lines: list[int]) -> tuple[list[str], bool]:
    """The query id of each request; True when they are ``line-<n>`` (some custom_id is not an id)."""
    if all(ID_RE.match(c) for c in custom_ids):
        return custom_ids, False
    return [f"line-{n}" for n in lines], True


class _Errors:
    """The errors of an input file, the first ``MAX_ERRORS`` listed, the rest counted."""

    def __init__(self) -> None:
        self.listed: list[LineError] = []
        self.more = 0

    def add(self, line: int | None, message: str, code: str = "invalid_request") -> None:
        if len(self.listed) < MAX_ERRORS:
            self.listed.append(LineError(f"line {line}: {message}" if line else message, line, code))
        else:
            self.more += 1

    def raise_any(self) -> None:
        self.listed.sort(key=lambda e: e.line or 0)
        if self.more:
            self.listed.append(LineError(f"and {self.more} more lines with errors", None, "too_many_errors"))
        if self.listed:
            raise InvalidFile(self.listed)


@dataclass(frozen=True)
class Scanned:
    """What :func:`scan_input` found in a valid input file: each request's line, whether the
    queries are named ``line-<n>`` (some ``custom_id`` is not a query id), and the requests' bytes
    (prompt and body, as :func:`request_parts` counts them)."""

    lines: Sequence[int]
    as_lines: bool
    size: int


def _requests(
    lines: Iterable[bytes], endpoint: str, template: ChatTemplate, errors: _Errors | None
) -> Iterator[tuple[int, OpenAIRequest]]:
    """``(line number, request)`` of each non-empty line; a bad line goes to ``errors`` (None: raises)."""
    for n, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw)
        except (ValueError, RecursionError) as e:  # RecursionError: nesting too deep
            if errors is None:
                raise
            errors.add(n, f"not valid JSON ({e})", "invalid_json_line")
            continue
        try:
            yield n, parse_row(row, 0, template, endpoint)
        except (ValueError, RecursionError) as e:
            if errors is None:
                raise
            errors.add(n, str(e))


def _query(q: pb.Query, r: OpenAIRequest) -> None:
    """Fill ``q`` with the request ``r``; ``ValueError`` when protobuf refuses a value."""
    q.prompt, q.max_tokens, q.openai_body = r.prompt, r.max_tokens, r.openai_body
    q.sampling.temperature, q.sampling.top_p = r.temperature, r.top_p
    if r.seed is not None:
        q.sampling.seed = r.seed


def scan_input(
    lines: Iterable[bytes], endpoint: str, template: ChatTemplate, limits: Limits | None = None
) -> Scanned:
    """Check an input file line by line, holding only each line's ``custom_id``: :class:`InvalidFile`
    naming every bad line (the first ``MAX_ERRORS``). With ``limits``, each query is also checked as the
    gateway will (:func:`gateway.checks.validation.query_problems`, no tokenizing), so those problems
    name their line too."""
    numbers = array("L")  # 8 bytes a request, not a list's 36
    seen: dict[str, int] = {}
    errors, ids, size = _Errors(), True, 0
    for n, r in _requests(lines, endpoint, template, errors):
        if r.custom_id in seen:
            errors.add(n, f"custom_id {r.custom_id!r} appears twice (also line {seen[r.custom_id]})",
                       "duplicate_custom_id")  # fmt: skip
            continue
        seen[r.custom_id] = n
        q = pb.Query(id=r.custom_id if ID_RE.match(r.custom_id) else f"line-{n}")
        try:  # parse_row checked every value; protobuf is the judge of last resort
            _query(q, r)
        except ValueError as e:
            errors.add(n, f"cannot be sent: {e}")
            continue
        for problem in query_problems(q, limits) if limits else ():
            errors.add(n, problem)
        numbers.append(n)
        ids = ids and bool(ID_RE.match(r.custom_id))
        size += _size(r)
    if not numbers and not errors.listed:
        errors.add(None, "the input file holds no requests", "empty_file")
    errors.raise_any()
    return Scanned(numbers, not ids, size)


def _size(r: OpenAIRequest) -> int:
    return len(r.prompt) + len(r.openai_body) + 64


def request_parts(
    lines: Iterable[bytes],
    endpoint: str,
    template: ChatTemplate,
    scanned: Scanned,
    first: pb.SubmitBatchRequest,
    part_bytes: int = 0,
) -> Iterator[pb.SubmitBatchRequest]:
    """The submission of an input file :func:`scan_input` found valid, in messages of about
    ``part_bytes`` of input each (``first`` carries the batch's settings; the last sets
    ``end_of_batch``; ``part_bytes`` 0: ``PART_BYTES``): one message at a time is held, never the file."""
    msg, size, part_bytes = first, 0, part_bytes or PART_BYTES
    for n, r in _requests(lines, endpoint, template, None):
        _query(msg.queries.add(id=f"line-{n}" if scanned.as_lines else r.custom_id), r)
        size += _size(r)
        if size >= part_bytes:
            yield msg
            msg, size = pb.SubmitBatchRequest(), 0
    msg.end_of_batch = True
    yield msg


def whole_request(
    lines: Iterable[bytes],
    endpoint: str,
    template: ChatTemplate,
    scanned: Scanned,
    first: pb.SubmitBatchRequest,
) -> pb.SubmitBatchRequest:
    """The submission of a small valid input file as one message (``first``, filled)."""
    (req,) = request_parts(lines, endpoint, template, scanned, first, part_bytes=1 << 62)
    req.end_of_batch = False
    return req


def errors_of(problems: list[tuple[int | None, str]], lines: Sequence[int]) -> list[LineError]:
    """The gateway's problems (by query position, :func:`gateway.checks.validation.problems_by_query`)
    of the submission :func:`request_parts` made, by input file line (``lines``: each query's)."""
    errors = _Errors()
    for i, message in problems:
        errors.add(lines[i] if i is not None and 0 <= i < len(lines) else None, message)
    try:
        errors.raise_any()
    except InvalidFile as e:
        return e.errors
    return []


def fail_invalid(pipe, batch_id: str, errors: list[LineError]) -> None:
    """Queue on ``pipe`` what marks a batch whose input file is invalid ``failed`` (``errors``),
    finalized at once (there is nothing to write) and out of the pending set."""
    now = time.time()
    data = json.dumps([e.as_json() for e in errors], ensure_ascii=False)
    pipe.hset(record_key(batch_id), mapping={"invalid": data, "finalized_at": now})
    pipe.srem(PENDING, batch_id)


def names_of(lines: Iterable[bytes]) -> dict[str, tuple[str, str]]:
    """``query id -> (custom_id, model)`` of an input file (as :func:`request_parts` named them)."""
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


def note_progress(
    queue: WorkQueue, batch_id: str, info: BatchInfo | None, rec: dict, intake: bool | None = None
) -> None:
    """Record (once) in ``rec`` and its Redis hash when the batch became ``in_progress``.

    A batch created whole (no background intake) is ``in_progress`` from birth: the queue's own
    ``created_at``. A batch accepted for background intake (``intake``: whether its hash has
    ``intake_total``; None: read it) is ``validating`` until its first
    chunk lands and the queue keeps no time for that: it is the first time the front (a GET or
    the finalizer's pass every 0.5 s) sees it ``in_progress`` or beyond (``completed`` /
    ``failed``); one cancelled before the front saw it in progress keeps ``in_progress_at`` null.
    """
    if info is None or not rec or rec.get("in_progress_at") or info.status == BatchState.VALIDATING:
        return
    if intake is None:
        intake = queue.r.hexists(keys.batch(batch_id), "intake_total")
    if not intake:
        when = info.created_at
    elif info.status in (BatchState.IN_PROGRESS, BatchState.COMPLETED, BatchState.FAILED):
        when = time.time()
    else:
        return
    kept = set_record_once(queue.r, batch_id, "in_progress_at", when)
    rec["in_progress_at"] = kept or str(when)


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


def batch_objects(
    queue: WorkQueue, batch_ids: Iterable[str], client: str, etas: Mapping[str, Eta] | None = None
) -> dict[str, dict | None]:
    """OpenAI's batch objects of ``batch_ids`` as ``client`` sees them (None: no record, or another
    client's batch), read in one round trip (one more per batch first seen in progress); ``etas``: the
    batches' ETAs (:mod:`gateway.status.eta`), shown in the objects' ``fleetbatch`` extension."""
    ids = list(batch_ids)
    pipe = queue.r.pipeline(transaction=False)
    for b in ids:
        pipe.hgetall(keys.batch(b))
        pipe.hgetall(record_key(b))
    raw = pipe.execute()
    out: dict[str, dict | None] = {}
    for b, h, rec in zip(ids, raw[::2], raw[1::2], strict=True):
        if not rec or not owner_allows(h.get(OWNER_FIELD), client):  # a gRPC client's batch
            out[b] = None
            continue
        info = batch_info(b, h)
        note_progress(queue, b, info, rec, intake="intake_total" in h)
        out[b] = batch_object(b, info, rec, (etas or {}).get(b))
    return out
