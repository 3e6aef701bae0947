"""Validation of client batches: every problem found is named, and nothing is enqueued."""

from __future__ import annotations

import math
import re

from protos import fleetbatch_pb2 as pb

ID_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")


class InvalidBatch(ValueError):
    """A batch that cannot be accepted; ``problems`` lists each reason."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        shown = "; ".join(problems[:10])
        more = f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""
        super().__init__(shown + more)


def validate_batch(
    req: pb.SubmitBatchRequest,
    prompt_tokens: list[int],
    *,
    max_prompt_tokens: int,
    max_max_tokens: int,
    max_batch_queries: int,
) -> None:
    """Raise :class:`InvalidBatch` naming every bad query (by id or position)."""
    problems: list[str] = []
    if req.batch_id and not ID_RE.match(req.batch_id):
        problems.append(f"batch_id {req.batch_id!r} must be 1-128 characters of [A-Za-z0-9_.-]")
    if not req.queries:
        problems.append("the batch has no queries")
    if len(req.queries) > max_batch_queries:
        problems.append(f"the batch has {len(req.queries)} queries; the limit is {max_batch_queries}")
    seen: set[str] = set()
    for i, q in enumerate(req.queries):
        name = f"query #{i} ({q.id!r})" if q.id else f"query #{i}"
        if not q.id:
            problems.append(f"{name}: empty id")
        elif not ID_RE.match(q.id):
            problems.append(f"{name}: id must be 1-128 characters of [A-Za-z0-9_.-]")
        elif q.id in seen:
            problems.append(f"{name}: duplicate id")
        seen.add(q.id)
        if not q.prompt.strip():
            problems.append(f"{name}: empty prompt")
        elif prompt_tokens[i] > max_prompt_tokens:
            problems.append(f"{name}: prompt has {prompt_tokens[i]} tokens; the limit is {max_prompt_tokens}")
        if q.max_tokens < 0 or q.max_tokens > max_max_tokens:
            problems.append(f"{name}: max_tokens {q.max_tokens} outside [0, {max_max_tokens}]")
        s = q.sampling
        if not math.isfinite(s.temperature) or s.temperature < 0 or s.temperature > 10:
            problems.append(f"{name}: temperature {s.temperature} outside [0, 10]")
        if not math.isfinite(s.top_p) or s.top_p < 0 or s.top_p > 1:
            problems.append(f"{name}: top_p {s.top_p} outside (0, 1]")
        if s.HasField("seed") and s.seed < 0:
            problems.append(f"{name}: seed must be >= 0")
        if q.HasField("forced_length") and not 1 <= q.forced_length <= max_max_tokens:
            problems.append(f"{name}: forced_length {q.forced_length} outside [1, {max_max_tokens}]")
    if problems:
        raise InvalidBatch(problems)
