"""Submit a workload to the gateway over gRPC, stream its results, and summarise them.

Results are appended to ``out`` (JSONL) as they arrive, so a run cut short (the gateway
restarted, the client was stopped) leaves every result it saw on disk; ``resume`` streams on
from the results already in ``out`` (``start_index`` after the last one, duplicates skipped).
A stream broken by a gateway restart (``UNAVAILABLE``) is resumed the same way, for up to
``retry_s`` seconds.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import grpc
from google.protobuf.json_format import MessageToDict
from tqdm import tqdm

from gateway.grpc_api.tls import channel
from load.workload import WorkItem
from protos import fleetbatch_pb2 as pb
from protos import fleetbatch_pb2_grpc as pb_grpc

PART_ROWS = 2000  # queries per message of a batch sent in parts (~1 MB of typical prompts)
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
ON_BAD_QUERY = {
    "": pb.ON_BAD_QUERY_UNSPECIFIED,
    "reject": pb.ON_BAD_QUERY_REJECT,
    "fail-row": pb.ON_BAD_QUERY_FAIL_ROW,
}


def to_request(
    items: Sequence[WorkItem], batch_id: str = "", metadata: dict | None = None, on_bad_query: str = ""
) -> pb.SubmitBatchRequest:
    req = pb.SubmitBatchRequest(
        batch_id=batch_id, metadata=metadata or {}, on_bad_query=ON_BAD_QUERY[on_bad_query]
    )
    for it in items:
        q = req.queries.add(id=it.id, prompt=it.prompt, max_tokens=it.max_tokens, metadata=it.metadata)
        q.openai_body = it.openai_body
        q.sampling.temperature = it.temperature
        q.sampling.top_p = it.top_p
        if it.seed is not None:
            q.sampling.seed = int(it.seed)
        if it.forced_length is not None:
            q.forced_length = it.forced_length
    return req


def scan_results(path: str | Path) -> Iterator[dict]:
    """The result rows already in a JSONL file, one at a time (none if it is missing). A torn last line
    (the writer was killed mid-row) is cut off the file once the scan ends, so appending goes on from a
    whole row."""
    p = Path(path)
    if not p.exists():
        return
    good = 0
    with open(p, "rb") as f:
        for line in f:
            if not line.endswith(b"\n"):
                break
            try:
                row = json.loads(line)
            except ValueError:
                break
            good += len(line)
            if line.strip():
                yield row
    if good < p.stat().st_size:
        with open(p, "r+b") as f:
            f.truncate(good)


def read_results(path: str | Path) -> list[dict]:
    """:func:`scan_results` as a list."""
    return list(scan_results(path))


def result_row(r: pb.QueryResult) -> dict:
    """A streamed result as the JSON row ``--out`` and run directories hold."""
    return MessageToDict(r, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def stream_results(
    stub: pb_grpc.BatchServiceStub,
    batch_id: str,
    results: list[dict],
    *,
    on_row: Callable[[dict], None] = lambda row: None,
    timeout_s: float | None = None,
    retry_s: float = 60.0,
    keep: bool = True,
    seen: set[str] | None = None,
    start_index: int | None = None,
) -> None:
    """Append the batch's results after those in ``results`` until it is final (no duplicates); with
    ``keep`` False they only go to ``on_row`` (a million rows are not held in memory). ``seen``: the set
    of query ids to skip and to add to (shared with a :class:`Tally`: one set of ids, not two).

    A stream that breaks with ``UNAVAILABLE`` (gateway restarting) is opened again from the next
    index, with back-off, until ``retry_s`` passes without progress."""
    seen = seen if seen is not None else set()
    seen.update(r.get("query_id") for r in results)
    next_index = max((int(r.get("index", -1)) for r in results), default=-1) + 1
    if start_index is not None:  # the rows before were counted by the caller, not passed in results
        next_index = max(next_index, start_index)
    last_progress = time.monotonic()
    delay = 0.2
    while True:
        req = pb.StreamResultsRequest(batch_id=batch_id, follow=True, start_index=next_index)
        try:
            for r in stub.StreamResults(req, timeout=timeout_s):
                next_index = max(next_index, r.index + 1)
                last_progress = time.monotonic()
                if r.query_id in seen:
                    continue
                seen.add(r.query_id)
                row = result_row(r)
                if keep:
                    results.append(row)
                on_row(row)
            return
        except grpc.RpcError as e:
            if e.code() not in RETRYABLE or time.monotonic() - last_progress > retry_s:
                raise
            print(
                f"stream of batch {batch_id} broke ({e.code().name}); resuming at {next_index}",
                file=sys.stderr,
            )
            time.sleep(delay)
            delay = min(delay * 2, 5.0)


def request_parts(
    items: Iterable[WorkItem], batch_id: str, on_bad_query: str = "", rows: int = PART_ROWS
) -> Iterator[pb.SubmitBatchRequest]:
    """``items`` as the messages of ``SubmitBatchStream``: the batch's settings and its first ``rows`` queries,
    then ``rows`` queries a message, the last one marked ``end_of_batch``; built as the stream takes them
    (two parts held at most, never the whole batch)."""
    made = 0

    def message(chunk: list[WorkItem]) -> pb.SubmitBatchRequest:
        nonlocal made
        made += 1
        return to_request(chunk, batch_id, on_bad_query=on_bad_query) if made == 1 else to_request(chunk)

    pending: pb.SubmitBatchRequest | None = None
    part: list[WorkItem] = []
    for it in items:
        part.append(it)
        if len(part) == rows:
            if pending is not None:
                yield pending
            pending, part = message(part), []
    if part or pending is None:
        if pending is not None:
            yield pending
        pending = message(part)
    pending.end_of_batch = True
    yield pending


def _noting(
    parts: Iterator[pb.SubmitBatchRequest], failed: list[BaseException]
) -> Iterator[pb.SubmitBatchRequest]:
    """``parts``, until one fails to be made (a bad row of the file): that error goes to ``failed`` and the
    stream just ends, without ``end_of_batch``, so the gateway creates nothing and refuses the call; the
    error is the answer to give (raised, gRPC would log a traceback and say only 'Exception iterating
    requests!')."""
    try:
        yield from parts
    except Exception as e:
        failed.append(e)


def submit_parts(
    stub: pb_grpc.BatchServiceStub,
    items: Callable[[], Iterable[WorkItem]],
    batch_id: str,
    on_bad_query: str = "",
    retry_s: float = 60.0,
    part_rows: int = PART_ROWS,
) -> pb.Batch:
    """Send a batch in parts (``SubmitBatchStream``), reading ``items()`` as it goes. A stream broken by
    ``UNAVAILABLE`` is sent again from the start (``items()`` anew) with back-off for up to ``retry_s``
    seconds: the gateway created nothing, or, if it answered before the break, the same ``batch_id``
    finds the batch (idempotent)."""
    give_up, delay = time.monotonic() + retry_s, 0.5
    while True:
        failed: list[BaseException] = []  # gRPC reads the parts in its own thread and cancels the call
        parts = request_parts(items(), batch_id, on_bad_query, part_rows)
        first = next(parts)  # read before connecting: a bad row in it is named whether the gateway is up or not
        try:
            return stub.SubmitBatchStream(_noting(itertools.chain([first], parts), failed), timeout=3600)
        except grpc.RpcError as e:
            if failed:
                raise failed[0] from None
            if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > give_up:
                raise
            print(
                f"submitting batch {batch_id} broke (UNAVAILABLE: {e.details()}); sending it again",
                file=sys.stderr,
            )
            time.sleep(delay)
            delay = min(delay * 2, 5.0)


def run_batch(
    target: str,
    items: Sequence[WorkItem] | Callable[[], Iterable[WorkItem]],
    *,
    batch_id: str = "",
    progress: bool = True,
    timeout_s: float | None = None,
    out: str | Path | None = None,
    resume: bool = False,
    on_bad_query: str = "",
    retry_s: float = 60.0,
    tls_ca: str | None = None,
    token: str | None = None,
    on_row: Callable[[dict], None] = lambda row: None,
    keep: bool = True,
    part_rows: int = PART_ROWS,
    seen: set[str] | None = None,
) -> tuple[pb.Batch, list[dict], float]:
    """Submit (or with ``resume``, find ``batch_id``), stream every result until the batch is final.

    ``items``: a list is sent in one ``SubmitBatch``; a callable returning an iterable (a file read row by
    row) is sent in parts (:func:`submit_parts`) under ``batch_id`` (a new one when empty, so that a resent
    stream is idempotent). Returns (batch, results, wall seconds); with ``out``, results are appended
    there as they come (the file is started afresh unless resuming), and each goes to ``on_row``; with
    ``keep`` False, ``results`` stays empty. The batch id goes to stderr at once. ``token``: the client
    token sent with every call (None: ``$FLEETBATCH_TOKEN``)."""
    results: list[dict] = []
    seen = seen if seen is not None else set()
    before = start = 0
    for row in scan_results(out) if (out and resume) else ():  # read a row at a time: none kept unless keep
        seen.add(row.get("query_id"))
        start = max(start, int(row.get("index", -1)) + 1)
        before += 1
        if keep:
            results.append(row)
        on_row(row)
    if out and not resume:
        Path(out).write_text("")
    options = [("grpc.max_send_message_length", 512 * 1024 * 1024)]
    with channel(target, tls_ca, options, token=token) as ch:
        stub = pb_grpc.BatchServiceStub(ch)
        t0 = time.time()
        if resume:
            batch = stub.GetBatch(pb.GetBatchRequest(batch_id=batch_id), timeout=30, wait_for_ready=True)
        elif callable(items):
            batch_id = batch_id or uuid.uuid4().hex  # named before sending: a retry, or --resume, finds it
            print(f"submitting batch {batch_id} in parts", file=sys.stderr, flush=True)
            batch = submit_parts(stub, items, batch_id, on_bad_query, retry_s, part_rows)
        else:
            batch = stub.SubmitBatch(to_request(items, batch_id, on_bad_query=on_bad_query), timeout=600)
        print(f"batch {batch.id} ({batch.request_counts.total} queries)", file=sys.stderr, flush=True)
        bar = tqdm(
            total=batch.request_counts.total,
            initial=before,
            desc=f"batch {batch.id[:8]}",
            unit="q",
            disable=not progress,
        )
        # line-buffered: every row is in the file once written, for a later --resume
        sink = open(out, "a", encoding="utf-8", buffering=1) if out else None  # noqa: SIM115 - closed below

        def each_row(row: dict) -> None:
            bar.update(1)
            if sink is not None:
                sink.write(json.dumps(row, ensure_ascii=False) + "\n")
            on_row(row)

        try:
            stream_results(
                stub,
                batch.id,
                results,
                on_row=each_row,
                timeout_s=timeout_s,
                retry_s=retry_s,
                keep=keep,
                seen=seen,
                start_index=start,
            )
        finally:
            bar.close()
            if sink is not None:
                sink.flush()
                os.fsync(sink.fileno())
                sink.close()
        wall = time.time() - t0
        batch = stub.GetBatch(pb.GetBatchRequest(batch_id=batch.id), timeout=30, wait_for_ready=True)
    return batch, results, wall


class Tally:
    """A batch's results counted as they come (:meth:`add`), for :meth:`summary`: no row is kept."""

    def __init__(self) -> None:
        self.per: dict[str, dict] = defaultdict(
            lambda: {
                "queries": 0,
                "completion_tokens": 0,
                "prompt_tokens": 0,
                "predicted": 0.0,
                "last_finish": 0.0,
            }
        )
        self.reasons: dict[str, int] = defaultdict(int)
        self.ids: set[str] = set()
        self.rows = 0
        self.first_enqueue = 0.0

    def add(self, r: dict) -> None:
        """Count one result (``ids`` may be the set a results stream already added it to)."""
        self.rows += 1
        self.ids.add(r["query_id"])
        self.reasons[r.get("finish_reason", "")] += 1
        timings = r.get("timings") or {}
        t = float(timings.get("enqueued_at") or 0)
        if t > 0:  # a row failed at intake was never enqueued (0)
            self.first_enqueue = min(self.first_enqueue, t) if self.first_enqueue else t
        c = self.per[r.get("cluster") or "-"]
        c["queries"] += 1
        c["completion_tokens"] += int(r.get("completion_tokens", 0))
        c["prompt_tokens"] += int(r.get("prompt_tokens", 0))
        c["predicted"] += float(r.get("predicted_tokens") or 0.0)
        c["last_finish"] = max(c["last_finish"], float(timings.get("finished_at", 0)))

    def summary(self, batch: pb.Batch, wall_s: float) -> dict:
        """Per-cluster and total figures of the finished ``batch``."""
        first = self.first_enqueue
        clusters = {
            name: {
                "queries": c["queries"],
                "prompt_tokens": c["prompt_tokens"],
                "completion_tokens": c["completion_tokens"],
                "predicted_completion_tokens": round(c["predicted"], 1),
                "finished_after_s": round(c["last_finish"] - first, 2) if first else None,
            }
            for name, c in sorted(self.per.items())
        }
        total_tokens = sum(c["completion_tokens"] for c in self.per.values())
        return {
            "batch_id": batch.id,
            "status": pb.BatchStatus.Name(batch.status).lower(),
            "queries": batch.request_counts.total,
            "completed": batch.request_counts.completed,
            "failed": batch.request_counts.failed,
            "cancelled": batch.request_counts.cancelled,
            "results": self.rows,
            "duplicates": self.rows - len(self.ids),
            "wall_s": round(wall_s, 2),
            "completion_tokens": total_tokens,
            "tokens_per_s": round(total_tokens / wall_s, 1) if wall_s > 0 else 0.0,
            "finish_reasons": dict(self.reasons),
            "clusters": clusters,
        }


def summarise(batch: pb.Batch, results: Iterable[dict], wall_s: float) -> dict:
    """Per-cluster and total figures of a finished batch."""
    tally = Tally()
    for r in results:
        tally.add(r)
    return tally.summary(batch, wall_s)


def format_summary(s: dict) -> str:
    lines = [
        f"batch {s['batch_id']}: {s['status']}, {s['completed']}/{s['queries']} completed, "
        f"{s['failed']} failed, {s['cancelled']} cancelled in {s['wall_s']} s "
        f"({s['completion_tokens']} tokens, {s['tokens_per_s']} tokens/s)",
        f"{'cluster':<12} {'queries':>8} {'prompt tok':>11} {'predicted out':>14} {'output tok':>11} {'done after s':>13}",
    ]
    for name, c in s["clusters"].items():
        lines.append(
            f"{name:<12} {c['queries']:>8} {c['prompt_tokens']:>11} {c.get('predicted_completion_tokens', 0):>14.0f} "
            f"{c['completion_tokens']:>11} {c['finished_after_s'] or 0:>13.1f}"
        )
    return "\n".join(lines)
