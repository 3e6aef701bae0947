"""A batch sent in parts (``SubmitBatchStream``): each part checked and staged in Redis as it arrives.

A batch too large for one message (a million rows of an OpenAI batch file) comes as a stream of
``SubmitBatchRequest`` messages: the first carries the batch's settings (``batch_id``, ``metadata``,
``on_bad_query``, ``completion_window``, ``priority``) and its first queries, each later one only
queries, and the last one sets ``end_of_batch``: a stream that stops before it was broken off (a cancelled
call's parts also just stop coming) and creates nothing. :func:`stage_parts` checks each part as :func:`gateway.checks.validation.check_batch` checks a
whole batch (positions count from the batch's start; an id is unique in the whole batch; with
``fail-row`` a bad row fails alone unless every row of the batch is bad), appends its rows to the
staging list and adds its queries to the batch's fingerprint, which is the fingerprint of the same
queries sent in one message (a retry may come either way). Neither client nor gateway holds the
whole batch: the gateway holds one part at a time.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from gateway.batches.errors import InvalidRequest
from gateway.batches.messages import Fingerprint
from gateway.checks.validation import ON_BAD_QUERY, InvalidBatch, Limits, Part, check_batch
from gateway.checks.windows import WindowError, check_priority, parse_window
from gateway.intake.rows import encode_rows
from protos import fleetbatch_pb2 as pb
from workqueue import WorkQueue
from workqueue.batches import STAGE_CHUNK


class StreamBrokenOff(Exception):
    """The parts stopped before the one that ends the batch (``end_of_batch``): a call cancelled mid-stream,
    or a client that half-closed too soon. Nothing is created either way."""


class Staging:
    """A batch's staging list (``key``) and the Redis call on it in flight (a part's append, or the batch's
    creation from it). A cancelled call goes on at once, but the Redis call goes on in its thread:
    :meth:`drop` waits for it, or an append would make the dropped list anew (to linger until it expires)
    and a creation could find it gone halfway."""

    def __init__(self, queue: WorkQueue, key: str) -> None:
        self.queue, self.key = queue, key
        self.staged = 0  # rows the list holds: each append says where it starts, so a resent one appends once
        self._busy: asyncio.Future | None = None

    async def _run(self, fn: Callable, *args):
        self._busy = asyncio.ensure_future(asyncio.to_thread(fn, *args))
        return await asyncio.shield(self._busy)

    async def append(self, rows) -> None:
        self.staged = await self._run(self.queue.stage_rows, self.key, rows, STAGE_CHUNK, self.staged)

    async def accept(self, create: Callable[[str], bool]) -> bool:
        """``create(key)``: the batch made from the list (True), run to its end even if the call is cancelled."""
        return await self._run(create, self.key)

    def drop(self) -> None:
        """Delete the list now, or once the call in flight has ended (after a creation it is gone already)."""
        busy = self._busy
        if busy is None or busy.done():
            self.queue.drop_stage(self.key)
            return

        def after(f: asyncio.Future) -> None:
            if not f.cancelled():
                f.exception()  # seen: the caller has gone, the list goes anyway
            self.queue.drop_stage(self.key)

        busy.add_done_callback(after)


@dataclass(frozen=True)
class Sent:
    """What the parts of a batch added up to."""

    total: int
    bad: int
    parts: int
    digest: str
    window_s: float


async def stage_parts(
    first: pb.SubmitBatchRequest,
    rest: AsyncIterator[pb.SubmitBatchRequest],
    *,
    count_tokens: Callable[[list[str]], list[int]],
    bound: Callable[[str], int] | None,
    limits: Limits,
    default_mode: str,
    stage: Staging | None,
) -> Sent:
    """Check ``first`` and every message of ``rest``, appending their rows to the staging list ``stage``
    (None: only check and fingerprint them, for a batch that exists already). ``InvalidRequest`` names
    the first part's problems that reject the batch; ``default_mode``: the gateway's ``--on-bad-query``."""
    try:
        window_s = parse_window(first.completion_window)
        check_priority(first.priority)
    except WindowError as e:
        raise InvalidRequest(str(e)) from None
    mode = first.on_bad_query or ON_BAD_QUERY[default_mode]
    part, digest, bad = Part(), Fingerprint(), 0
    msg: pb.SubmitBatchRequest | None = first
    while msg is not None:
        try:
            checked = await asyncio.to_thread(
                check_batch,
                msg,
                count_tokens,
                limits,
                fail_row=mode == pb.ON_BAD_QUERY_FAIL_ROW,
                bound=bound,
                part=part,
            )
        except InvalidBatch as e:
            raise InvalidRequest(f"message {part.messages + 1} of the stream: {e}") from None
        if stage is not None and msg.queries:
            await stage.append(encode_rows(msg, checked))
        await asyncio.to_thread(digest.add, msg)
        bad += len(checked.bad)
        part.advance(msg)
        if msg.end_of_batch:  # the batch is whole: nothing after it is read
            break
        msg = await anext(rest, None)
    else:
        raise StreamBrokenOff(
            "the stream ended without a message that sets end_of_batch: nothing was created"
        )
    if part.offset == 0:
        raise InvalidRequest("the batch has no queries")
    if bad == part.offset:
        raise InvalidRequest("every query of the batch is bad (sent as fail-row: each failed its checks)")
    return Sent(part.offset, bad, part.messages, digest.hexdigest(), window_s)
