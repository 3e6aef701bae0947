"""The batch API's messages built from the queue's records: a batch (with its ETA), a result, a submission's
fingerprint, and the rows of a fail-row batch that fail alone."""

from __future__ import annotations

import hashlib
import json

from gateway.checks.windows import format_window
from gateway.status.eta import Eta
from protos import fleetbatch_pb2 as pb
from workqueue import BatchInfo, BatchState, QueryResult, QueryState, QueuedQuery, WorkQueue
from workqueue.records import Timings

STATUS = {
    BatchState.VALIDATING: pb.VALIDATING,
    BatchState.IN_PROGRESS: pb.IN_PROGRESS,
    BatchState.COMPLETED: pb.COMPLETED,
    BatchState.FAILED: pb.FAILED,
    BatchState.CANCELLING: pb.CANCELLING,
    BatchState.CANCELLED: pb.CANCELLED,
    BatchState.EXPIRING: pb.EXPIRING,
    BatchState.EXPIRED: pb.EXPIRED,
}


class Fingerprint:
    """:func:`fingerprint` taken message by message: a batch sent in parts gets the digest of the same
    queries sent in one message."""

    def __init__(self) -> None:
        self._h = hashlib.sha256()

    def add(self, request: pb.SubmitBatchRequest) -> None:
        for q in request.queries:
            self._h.update(q.SerializeToString(deterministic=True))
            self._h.update(b"\0")

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def fingerprint(request: pb.SubmitBatchRequest) -> str:
    """Digest of a submission's queries (ids, prompts, limits, sampling, metadata), in order."""
    f = Fingerprint()
    f.add(request)
    return f.hexdigest()


def batch_proto(b: BatchInfo, eta: Eta | None = None, cost_dollars: float | None = None) -> pb.Batch:
    """The batch on the wire, with its ETA when it is unfinished and one is known (:mod:`gateway.status.eta`), and
    its cost so far (``cost_dollars``: the meter's, :mod:`gateway.status.cost`; None: its ETA's)."""
    live = eta is not None and not b.final
    return pb.Batch(
        id=b.batch_id,
        status=STATUS.get(b.status, pb.BATCH_STATUS_UNSPECIFIED),
        request_counts=pb.RequestCounts(
            total=b.total, completed=b.completed, failed=b.failed, cancelled=b.cancelled
        ),
        created_at=b.created_at,
        completed_at=b.completed_at,
        metadata=b.metadata,
        queries_per_cluster=b.queries_per_cluster,
        predicted_tokens_per_cluster=b.predicted_tokens_per_cluster,
        policy=b.policy,
        deadline=b.deadline,
        completion_window=format_window(b.deadline - b.created_at) if b.deadline else "",
        priority=b.priority,
        predicted_finish_at=eta.finish_at if live else 0.0,
        at_risk=eta.at_risk if live else False,
        predicted_tokens=b.predicted_tokens,
        done_predicted_tokens=b.done_predicted_tokens,
        done_actual_tokens=b.done_actual_tokens,
        remaining_tokens=eta.remaining_tokens if live else 0.0,
        cost_dollars=cost_dollars if cost_dollars is not None else eta.cost_dollars if live else 0.0,
    )


def result_proto(r: QueryResult) -> pb.QueryResult:
    """A stored result on the wire (absent fields read as zero or empty)."""
    t = r.timings or Timings()
    return pb.QueryResult(
        batch_id=r.batch_id,
        query_id=r.query_id,
        text=r.text or "",
        prompt_tokens=int(r.prompt_tokens or 0),
        completion_tokens=int(r.completion_tokens or 0),
        cluster=r.cluster or "",
        timings=pb.Timings(
            enqueued_at=float(t.enqueued_at or 0),
            started_at=float(t.started_at or 0),
            first_token_at=float(t.first_token_at or 0),
            finished_at=float(t.finished_at or 0),
        ),
        finish_reason=r.finish_reason or "",
        error=r.error or "",
        predicted_tokens=float(r.predicted_tokens or 0),
        index=int(r.index or 0),
        attempts=int(r.attempts or 0),
        openai_extra=json.dumps(r.openai_extra, ensure_ascii=False) if r.openai_extra else "",
    )


def fail_rows(queue: WorkQueue, batch_id: str, request: pb.SubmitBatchRequest, bad: dict[int, str]) -> None:
    """Finish each bad query of a fail-row batch as failed, its problem in ``error``."""
    for i, problem in sorted(bad.items()):
        qid = request.queries[i].id
        result = QueryResult(batch_id, qid, finish_reason="error", error=f"invalid query: {problem}")
        queue.complete(QueuedQuery(batch_id, qid, "", 0, 0, 0.0).gid, result, QueryState.FAILED)
