"""The body of ``POST /v1/batches`` checked: one function, every field named in its 400.

Fields: ``input_file_id``, ``endpoint``, ``completion_window`` (``24h``, OpenAI's only value, or
any duration of :mod:`gateway.checks.windows`: this gateway's extension), ``metadata`` (strings to
strings, within the gateway's byte limit), ``output_expires_after`` (accepted, as OpenAI's), and
``priority`` (this gateway's extension: an integer from -100 to 100; OpenAI's clients send it with
``extra_body={"priority": 2}``).

:func:`submit_file` then submits the batch of the input file, read as a stream twice: every line
checked first (:func:`gateway.http_api.batches.scan_input`, holding only the ``custom_id`` s), then
sent: a small file (fewer than the intake's ``sync_max_queries`` requests, at most ``PART_BYTES``)
as one ``SubmitBatchRequest`` (assigned at once, as over gRPC), a larger one message by message
(about ``PART_BYTES`` of input each) as ``SubmitBatchStream`` sends it, each staged in Redis for the
background intake as it comes: the gateway never holds more than one message of the file.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass

from gateway.batches.errors import Caller, InvalidRequest
from gateway.batches.service import BatchService
from gateway.checks.validation import Limits, metadata_problem, problems_by_query
from gateway.checks.windows import WindowError, check_priority, parse_window
from gateway.http_api import batches as ob
from gateway.http_api.format import ENDPOINTS, ChatTemplate
from gateway.http_api.shared import ApiError, utf8_problem
from protos import fleetbatch_pb2 as pb

FIELDS = {"input_file_id", "endpoint", "completion_window", "metadata", "output_expires_after", "priority"}


@dataclass(frozen=True)
class CreateBatch:
    file_id: str
    endpoint: str
    window: str
    priority: int
    metadata: dict[str, str]


def check_create(body, limits: Limits) -> CreateBatch:
    """The creation ``body`` asks for; :class:`ApiError` (400) naming the first bad field."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise ApiError(400, f"unsupported fields: {', '.join(unknown)}", unknown[0])
    file_id, endpoint = body.get("input_file_id"), body.get("endpoint")
    window, metadata = body.get("completion_window"), body.get("metadata") or {}
    if not isinstance(file_id, str) or not file_id:
        raise ApiError(400, "input_file_id is required", "input_file_id")
    if endpoint not in ENDPOINTS:
        raise ApiError(400, f"endpoint {endpoint!r} is not supported ({', '.join(ENDPOINTS)})", "endpoint")
    if not isinstance(window, str):
        raise ApiError(
            400, f"completion_window must be a duration such as '24h', not {window!r}", "completion_window"
        )
    priority = body.get("priority", 0)
    try:
        parse_window(window)
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise WindowError(f"priority must be an integer, not {priority!r}")
        check_priority(priority)
    except WindowError as e:
        raise ApiError(
            400, str(e), "priority" if str(e).startswith("priority") else "completion_window"
        ) from None
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise ApiError(400, "metadata must map strings to strings", "metadata")
    problem = utf8_problem(metadata) or metadata_problem(metadata, limits.max_metadata_bytes)
    if problem:
        raise ApiError(400, problem, "metadata")
    return CreateBatch(file_id, endpoint, window, priority, metadata)


async def submit_file(
    service: BatchService,
    lines: Callable[[], Iterable[bytes]],
    template: ChatTemplate,
    limits: Limits,
    c: CreateBatch,
    batch_id: str,
    caller: Caller,
) -> list[ob.LineError]:
    """Submit the batch of the input file ``lines()`` reads (twice); the errors of an invalid file,
    each naming its line (nothing submitted), else ``[]``. The service's other refusals are raised."""
    try:
        scanned = await asyncio.to_thread(ob.scan_input, lines(), c.endpoint, template, limits)
    except ob.InvalidFile as e:
        return e.errors
    first = pb.SubmitBatchRequest(
        batch_id=batch_id, metadata=c.metadata, on_bad_query=pb.ON_BAD_QUERY_REJECT,
        completion_window=c.window, priority=c.priority,
    )  # fmt: skip
    try:
        if len(scanned.lines) < service.d.intake.sync_max_queries and scanned.size <= ob.PART_BYTES:
            whole = ob.whole_request, lines(), c.endpoint, template, scanned, first
            await service.submit(await asyncio.to_thread(*whole), caller)
        else:
            parts = ob.request_parts(lines(), c.endpoint, template, scanned, first)
            await service.submit_parts(_each(parts), caller)
    except InvalidRequest as e:  # the request's own fields were checked: these are the file's problems
        problems = problems_by_query(re.sub(r"^message \d+ of the stream: ", "", str(e)))
        return ob.errors_of(problems, scanned.lines)
    return []


async def _each(parts: Iterator[pb.SubmitBatchRequest]) -> AsyncIterator[pb.SubmitBatchRequest]:
    """The messages of ``parts``, each made (its lines read) in a worker thread."""
    while (msg := await asyncio.to_thread(next, parts, None)) is not None:
        yield msg
