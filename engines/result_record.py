"""The result record a worker writes for a finished query: one place builds it (the queue agent writes it)."""

from __future__ import annotations

import time

from engines.interface import RequestOutput
from workqueue import ClaimedQuery, outcome
from workqueue.records import QueryResult, QueryState, Timings
from workqueue.worker_tick import Finished


def finished_record(cluster: str, cq: ClaimedQuery, out: RequestOutput) -> Finished:
    """The result record of a query ``cluster`` finished (every field set), its state and its tokens."""
    q, how = cq.query, outcome(out.finish_reason, out.error)
    result = QueryResult(
        batch_id=q.batch_id,
        query_id=q.query_id,
        text=out.text,
        prompt_tokens=out.prompt_tokens,
        completion_tokens=out.completion_tokens,
        cluster=cluster,
        timings=Timings(
            enqueued_at=cq.enqueued_at,
            started_at=cq.claimed_at,
            first_token_at=out.first_token_time,
            finished_at=out.finish_time or time.time(),
        ),
        finish_reason="cancelled" if how.state == QueryState.CANCELLED else out.finish_reason,
        error=out.error,
        predicted_tokens=q.predicted_tokens,
        attempts=cq.attempts,
        openai_extra=out.openai_extra or None,
    )
    return Finished(q.gid, result, how.state, out.completion_tokens)
