"""A submission whose ``batch_id`` exists already: a retry of the same submission gets the batch back,
anything else with its id is ``Conflict`` (``ALREADY_EXISTS``), as is a caller who is not its owner (a retry
makes one without an owner the caller's). One rule for whole and streamed submissions."""

from __future__ import annotations

import asyncio

from gateway.batches import quota
from gateway.batches.errors import Caller, Conflict
from gateway.checks.windows import parse_window
from protos import fleetbatch_pb2 as pb
from workqueue import BatchInfo, WorkQueue


async def check_resubmission(
    queue: WorkQueue,
    existing: BatchInfo,
    caller: Caller,
    settings: pb.SubmitBatchRequest,
    total: int,
    digest: str,
) -> None:
    """Refuse (``Conflict``) unless the submission of ``total`` queries with fingerprint ``digest`` and the
    completion window and priority of ``settings`` is ``existing`` sent again by a caller who may have it."""
    owner, taken = caller.owner, f"batch_id {existing.batch_id!r} is taken"
    if not await asyncio.to_thread(quota.may_see, queue, existing.batch_id, owner):
        raise Conflict(taken)  # tells another's batch nothing more
    window, asked = existing.deadline - existing.created_at, parse_window(settings.completion_window)
    if existing.priority != settings.priority or (existing.deadline and abs(window - asked) > 1.0):
        raise Conflict(
            f"batch {existing.batch_id} exists with another completion window or priority; choose a new batch_id"
        )
    if existing.total != total:
        raise Conflict(
            f"batch {existing.batch_id} exists with {existing.total} queries, this submission has {total}"
        )
    if existing.fingerprint and existing.fingerprint != digest:
        raise Conflict(
            f"batch {existing.batch_id} exists with other queries (same count, different ids, prompts "
            "or settings); choose a new batch_id"
        )
    if not await asyncio.to_thread(quota.may_resubmit, queue, existing.batch_id, owner):
        raise Conflict(taken)  # another claimed it meanwhile
