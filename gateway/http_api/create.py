"""The body of ``POST /v1/batches`` checked: one function, every field named in its 400.

Fields: ``input_file_id``, ``endpoint``, ``completion_window`` (``24h``, OpenAI's only value, or
any duration of :mod:`gateway.checks.windows`: this gateway's extension), ``metadata`` (strings to
strings, within the gateway's byte limit), ``output_expires_after`` (accepted, as OpenAI's), and
``priority`` (this gateway's extension: an integer from -100 to 100; OpenAI's clients send it with
``extra_body={"priority": 2}``).
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.checks.validation import Limits, metadata_problem
from gateway.checks.windows import WindowError, check_priority, parse_window
from gateway.http_api.format import ENDPOINTS
from gateway.http_api.shared import ApiError, utf8_problem

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
