"""The queue agent's arithmetic and records, apart from its thread (:mod:`engines.queue_agent`): how many queries
to claim ahead, what a written result adds to the observed lengths."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable

from engines.interface import RequestOutput
from engines.worker_config import WorkerConfig
from workqueue import ClaimedQuery, Observation, outcome
from workqueue.scripts import RESENT

log = logging.getLogger(__name__)


def claim_ahead(
    c: WorkerConfig,
    free_slots: int,
    inbox: Iterable[ClaimedQuery],
    mean: float,
    rate_tps: float,
    tick_s: float,
) -> int:
    """Queries to claim now: what the engine can take (``free_slots`` less the ``inbox``), plus the claim-ahead
    horizon's at ``rate_tps``, counted in predicted tokens (``mean``: of the queries claimed) (the agent's docstring)."""
    inbox = list(inbox)
    waiting = len(inbox)
    waiting_tokens = sum(max(float(cq.query.predicted_tokens or 0), mean) for cq in inbox)
    now_n = max(0, free_slots - waiting)
    ahead_room = c.max_ahead - max(0, waiting - free_slots)  # the inbox's ahead part is bounded
    horizon_s = min(c.claim_ahead_s, c.lease_s / 3, 3 * tick_s)
    need = rate_tps * horizon_s - waiting_tokens
    if need <= 1e-6 or mean <= 0 or ahead_room <= 0:
        return now_n
    return now_n + min(ahead_room, math.ceil(round(need / mean, 6)))


def observation(c: WorkerConfig, cq: ClaimedQuery, out: RequestOutput, idx: int) -> Observation | None:
    """What a result written at ``idx`` (COMPLETE's reply) adds to the observed lengths (None: nothing)."""
    q = cq.query
    if idx == RESENT:  # recorded by this run's first send, whose reply was lost: observed as any other
        log.info("query %s: write resent (its reply was lost), recorded once", q.gid)
    elif idx < 0:
        log.info("query %s already had a result (it ran twice); kept the first", q.gid)
        return None
    retrain = c.record_observed and q.forced_length is None
    if not (outcome(out.finish_reason, out.error).answered and (retrain or c.length_model)):
        return None
    raw = q.predicted_tokens if q.raw_predicted_tokens is None else q.raw_predicted_tokens
    raw = min(raw, q.max_tokens)  # capped as its answer is: a short cap says nothing of the model
    return Observation(q.prompt, out.completion_tokens, q.metadata.get("source", ""), c.cluster, raw, retrain)


def heartbeat_record(
    fields: dict[str, float | int | str],
    worker_id: str,
    held: list[ClaimedQuery],
    claimed_ahead: int,
    tick_s: float,
) -> dict[str, float | int | str]:
    """The heartbeat: the step loop's ``fields`` and the agent's own (``held``: the queries it holds)."""
    return {
        **fields,
        "worker": worker_id,
        "inflight": len(held),
        "running_remaining_tokens": sum((cq.query.predicted_tokens for cq in held), 0.0),
        "claimed_ahead": claimed_ahead,
        "tick_ms": round(1000 * tick_s, 3),
    }
