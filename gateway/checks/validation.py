"""Validation of client batches and admin input: every problem found is named, and nothing is enqueued.

Checks run cheapest first: ids and sizes (bytes) before any prompt is tokenized, so a huge
prompt costs a length check, not seconds of tokenizing. Only prompts that passed the byte
checks are tokenized (start token counted, as the engine counts it), then checked against
``max_prompt_tokens`` and the model's positions: a prompt needs at least one free position
for the token it generates, and a ``forced_length`` must fit after the prompt. A large batch
skips tokenizing the prompts that a byte bound (:mod:`gateway.assign.tokens`) proves short enough:
the background intake counts them.

Problems of a batch (its id, size, metadata) and of a row's identity (empty, malformed or
duplicate ids) always reject the batch. Other row problems either reject it too
(``reject``) or fail that row alone (``fail-row``, see :func:`check_batch`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from gateway.checks.serving import Serving
from gateway.config import NAME_RE, GatewayConfig
from protos import fleetbatch_pb2 as pb
from workqueue.openai_body import parse_body

ID_RE = NAME_RE
ALPHABET = "1-128 characters of [A-Za-z0-9_.-]"
ON_BAD_QUERY = {"reject": pb.ON_BAD_QUERY_REJECT, "fail-row": pb.ON_BAD_QUERY_FAIL_ROW}
#: The range of every number a client gives a query, the one rule for both roads in: each fits
#: the protobuf field it crosses into (``Query.max_tokens`` and ``forced_length`` int32,
#: ``Sampling.seed`` int64, ``temperature`` and ``top_p`` float32) and what the engines take. An
#: OpenAI input line is checked before its message is built (protobuf raises on a number past its
#: range: that was a 500), a gRPC message by :func:`query_problems`. The gateway's configurable
#: bound on ``max_tokens`` and ``forced_length`` (``max_max_tokens``) is checked after, on the message.
NUMBER_RANGES: dict[str, tuple[int, int] | tuple[float, float]] = {
    "max_tokens": (0, 2**31 - 1),
    "forced_length": (1, 2**31 - 1),
    "seed": (0, 2**63 - 1),
    "temperature": (0.0, 10.0),
    "top_p": (0.0, 1.0),  # 0 is read as 1
}


class InvalidBatch(ValueError):
    """A batch that cannot be accepted; ``problems`` lists each reason (a query's first names it:
    ``query #<position> ('<id>'): ``); the message shows the first ten, ``"; "`` between them."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        shown = "; ".join(problems[:10])
        more = f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""
        super().__init__(shown + more)


_QUERY = re.compile(r"query #(\d+)(?: \('[^']*'\))?: ")


def problems_by_query(message: str) -> list[tuple[int | None, str]]:
    """The problems of an :class:`InvalidBatch` message (as a gRPC status carries it), each with
    its query's position (None: the batch's own), the query's name taken off."""
    out: list[tuple[int | None, str]] = []
    for part in re.split(r"; (?=query #\d+)", message):
        m = _QUERY.match(part)
        out.append((int(m.group(1)), part[m.end() :]) if m else (None, part))
    return out


@dataclass(frozen=True)
class Limits:
    """The gateway's limits on one batch (see :class:`gateway.config.GatewayConfig`)."""

    max_prompt_tokens: int = 2048
    max_max_tokens: int = 4096
    default_max_tokens: int = 256
    max_batch_queries: int = 1_000_000
    max_prompt_bytes: int = 256 * 1024
    max_metadata_bytes: int = 16 * 1024
    max_positions: int = 2048
    serving: Serving = Serving()  # what the clusters serve, read at each submission (gateway.checks.serving)

    @classmethod
    def of(cls, config: GatewayConfig) -> Limits:
        return cls(
            max_prompt_tokens=config.max_prompt_tokens,
            max_max_tokens=config.max_max_tokens,
            default_max_tokens=config.default_max_tokens,
            max_batch_queries=config.max_batch_queries,
            max_prompt_bytes=config.max_prompt_bytes,
            max_metadata_bytes=config.max_metadata_bytes,
            max_positions=config.model_positions(),
        )


@dataclass
class Checked:
    """A batch that passed: each query's prompt tokens and ``max_tokens``; ``bad`` rows (fail-row) by
    index; ``uncounted`` rows (by index, with their :func:`prompt_token_cap`) were proved to fit by a
    token bound and not tokenized (their ``prompt_tokens`` is 0): the background intake counts them."""

    prompt_tokens: list[int]
    max_tokens: list[int]
    bad: dict[int, str] = field(default_factory=dict)
    uncounted: dict[int, int] = field(default_factory=dict)
    window_s: float = 0.0  # its completion window: it expires this long after its creation


def id_problem(value: str, what: str) -> str | None:
    """Why ``value`` cannot be an id that becomes part of a Redis key, or None."""
    if not value:
        return f"{what} is empty"
    if not ID_RE.match(value):
        shown = value if len(value) <= 40 else value[:40] + "..."
        return f"{what} {shown!r} must be {ALPHABET}"
    return None


def _shown(value: int | float) -> str:
    """A number for a message (Python refuses to print an int of more than 4,300 digits)."""
    if isinstance(value, int) and abs(value) >= 2**64:
        return f"{'a negative' if value < 0 else 'an'} integer of {abs(value).bit_length()} bits"
    return repr(value)


def number_problem(field: str, value: object, name: str | None = None) -> str | None:
    """Why ``value`` cannot be the query's number ``field`` (:data:`NUMBER_RANGES`), or None;
    ``name``: the field as the client called it (``max_completion_tokens``), for the message."""
    low, high = NUMBER_RANGES[field]
    if type(value) is float and isinstance(low, float) and low <= value <= high:
        return None  # the common case, answered before the checks below (which it passes)
    name = name or field
    whole = isinstance(low, int)
    if isinstance(value, bool) or not isinstance(value, int | float):
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:40] + "..."
        return f"{name} must be a {'whole ' if whole else ''}number, not {shown}"
    if isinstance(value, float) and not math.isfinite(value):
        return f"{name} must be a finite number, not {value}"
    if whole and isinstance(value, float) and not value.is_integer():
        return f"{name} must be a whole number, not {value!r}"
    if not low <= value <= high:
        return f"{name} {_shown(value)} outside [{low}, {high}]"
    return None


def metadata_problem(md: Mapping[str, str], limit: int, what: str = "metadata") -> str | None:
    if not md:
        return None
    size = 0
    for k, v in md.items():
        size += len(k) + len(v)
        if size > limit:  # characters are a lower bound of bytes: stop early on huge maps
            return f"{what} has more than {limit} bytes; the limit is max_metadata_bytes={limit}"
    size = sum(len(k.encode()) + len(v.encode()) for k, v in md.items())
    if size > limit:
        return f"{what} has {size} bytes; the limit is max_metadata_bytes={limit}"
    return None


def batch_problems(req: pb.SubmitBatchRequest, limits: Limits) -> list[str]:
    """Problems that reject the whole batch: its id, size and metadata, and bad or duplicate query ids."""
    problems = settings_problems(req, limits)
    if not req.queries:
        problems.append("the batch has no queries")
    if len(req.queries) > limits.max_batch_queries:
        problems.append(f"the batch has {len(req.queries)} queries; the limit is {limits.max_batch_queries}")
    problems.extend(id_problems(req.queries, set()))
    return problems


def settings_problems(req: pb.SubmitBatchRequest, limits: Limits) -> list[str]:
    """Problems of the batch's own settings that validation checks here: its id and its metadata."""
    problems: list[str] = []
    if req.batch_id and not ID_RE.match(req.batch_id):
        problems.append(id_problem(req.batch_id, "batch_id") or "")
    md = metadata_problem(req.metadata, limits.max_metadata_bytes, "batch metadata")
    if md:
        problems.append(md)
    return problems


def id_problems(queries: Sequence[pb.Query], seen: set[str], offset: int = 0) -> list[str]:
    """Empty, malformed and duplicate query ids (``seen``: the ids before these, updated); ``offset``: the
    position of the first of ``queries`` in its batch."""
    problems: list[str] = []
    for i, q in enumerate(queries, offset):
        qid = q.id  # each read of a proto string field copies it
        if not qid:
            problems.append(f"query #{i}: empty id")
        elif not ID_RE.match(qid):
            problems.append(f"{_name(i, q)}: id must be {ALPHABET}")
        elif qid in seen:
            problems.append(f"{_name(i, q)}: duplicate id")
        seen.add(qid)
    return problems


@dataclass
class Part:
    """Where one message of a batch sent in parts (``SubmitBatchStream``) stands: the queries of the parts
    before it (``offset``) and their ids (an id is unique in the whole batch). Only the first part may
    carry the batch's settings; :meth:`advance` moves on to the next part."""

    offset: int = 0
    messages: int = 0
    seen: set[str] = field(default_factory=set)

    def problems(self, req: pb.SubmitBatchRequest, limits: Limits) -> list[str]:
        """What rejects the whole batch in this part (its ids are added to ``seen``)."""
        if self.messages == 0:
            problems = settings_problems(req, limits)
        elif req.batch_id or req.metadata or req.completion_window or req.priority or req.on_bad_query:
            problems = [
                f"message {self.messages + 1} of the stream sets the batch's settings (batch_id, metadata, "
                "on_bad_query, completion_window, priority): only the first message may"
            ]
        else:
            problems = []
        if self.offset + len(req.queries) > limits.max_batch_queries:
            problems.append(f"the batch has more than {limits.max_batch_queries} queries (the limit)")
        problems.extend(id_problems(req.queries, self.seen, self.offset))
        return problems

    def advance(self, req: pb.SubmitBatchRequest) -> None:
        self.offset += len(req.queries)
        self.messages += 1


def _name(i: int, q: pb.Query) -> str:
    if not q.id:
        return f"query #{i}"
    shown = q.id if len(q.id) <= 40 else q.id[:40] + "..."
    return f"query #{i} ({shown!r})"


def effective_max_tokens(q: pb.Query, limits: Limits) -> int:
    """``max_tokens``, else ``forced_length``, else the gateway default."""
    if q.max_tokens:
        return q.max_tokens
    if q.HasField("forced_length") and q.forced_length > 0:
        return q.forced_length
    return limits.default_max_tokens


def query_problems(q: pb.Query, limits: Limits) -> list[str]:
    """Problems of one query found without tokenizing (sizes first)."""
    out: list[str] = []
    prompt = q.prompt  # each read of a proto string field copies it
    n = len(prompt)
    if n > limits.max_prompt_bytes:  # characters are a lower bound of bytes
        out.append(f"prompt has {n} characters, more than max_prompt_bytes={limits.max_prompt_bytes} bytes")
    elif 4 * n > limits.max_prompt_bytes and (size := len(prompt.encode())) > limits.max_prompt_bytes:
        out.append(f"prompt has {size} bytes; the limit is max_prompt_bytes={limits.max_prompt_bytes}")
    elif not prompt.strip():
        out.append("empty prompt")
    md = metadata_problem(q.metadata, limits.max_metadata_bytes)
    if md:
        out.append(md)
    if q.openai_body:
        try:
            parse_body(q.openai_body)
        except ValueError as e:
            out.append(str(e))
        out.extend(limits.serving.problems(q.openai_body))
    if q.max_tokens < 0 or q.max_tokens > limits.max_max_tokens:
        out.append(f"max_tokens {q.max_tokens} outside [0, {limits.max_max_tokens}]")
    s = q.sampling
    numbers = [("temperature", s.temperature), ("top_p", s.top_p)]
    if s.HasField("seed"):
        numbers.append(("seed", s.seed))
    out.extend(p for f, v in numbers if (p := number_problem(f, v)))
    if q.HasField("forced_length"):
        fl = q.forced_length
        if not 1 <= fl <= limits.max_max_tokens:
            out.append(f"forced_length {fl} outside [1, {limits.max_max_tokens}]")
        elif q.max_tokens > 0 and fl > q.max_tokens:
            out.append(f"forced_length {fl} exceeds max_tokens {q.max_tokens}")
    return out


def prompt_token_cap(q: pb.Query, limits: Limits) -> int:
    """The most prompt tokens (start token included) ``q`` may have: :func:`token_problems` finds
    none exactly when its count is at most this."""
    cap = limits.max_prompt_tokens
    if limits.max_positions:
        cap = min(cap, limits.max_positions - 1)
        if q.HasField("forced_length"):
            cap = min(cap, limits.max_positions - q.forced_length)
    return cap


def token_problems(q: pb.Query, tokens: int, limits: Limits) -> list[str]:
    """Problems of one query's tokenized prompt (start token counted)."""
    out: list[str] = []
    positions = limits.max_positions
    if tokens > limits.max_prompt_tokens:
        out.append(f"prompt has {tokens} tokens; the limit is {limits.max_prompt_tokens}")
    if positions and tokens >= positions:
        out.append(
            f"prompt has {tokens} tokens (start token included); the model's {positions} positions "
            f"leave room for at most {positions - 1}"
        )
    elif positions and q.HasField("forced_length") and tokens + q.forced_length > positions:
        out.append(
            f"forced_length {q.forced_length} after a prompt of {tokens} tokens exceeds the model's "
            f"{positions} positions"
        )
    return out


def check_batch(
    req: pb.SubmitBatchRequest,
    count_tokens: Callable[[list[str]], list[int]],
    limits: Limits,
    *,
    fail_row: bool = False,
    bound: Callable[[str], int] | None = None,
    part: Part | None = None,
) -> Checked:
    """Validate ``req``; tokenize only prompts that passed the size checks.

    With ``bound`` (an upper bound of a prompt's token count, :mod:`gateway.assign.tokens`), a prompt
    whose bound fits its :func:`prompt_token_cap` is not tokenized: it goes to
    :attr:`Checked.uncounted`, to be counted after the answer.

    Raises :class:`InvalidBatch` naming every problem (by query position and id). With
    ``fail_row``, row problems (prompt, sampling, lengths, metadata) do not raise: they come
    back in :attr:`Checked.bad`, unless every row is bad. ``part``: ``req`` is one message of a
    batch sent in parts (positions count from the batch's start; a part may be all bad: the caller
    checks the whole batch at its end).
    """
    problems = batch_problems(req, limits) if part is None else part.problems(req, limits)
    if problems:
        raise InvalidBatch(problems)
    queries: Sequence[pb.Query] = req.queries
    rows: dict[int, list[str]] = {}
    uncounted: dict[int, int] = {}
    for i, q in enumerate(queries):
        found = query_problems(q, limits)
        if found:
            rows[i] = found
        elif bound is not None and bound(q.prompt) <= (cap := prompt_token_cap(q, limits)):
            uncounted[i] = cap
    todo = [i for i in range(len(queries)) if i not in rows and i not in uncounted]
    counted = count_tokens([queries[i].prompt for i in todo]) if todo else []
    tokens = [0] * len(queries)
    for i, n in zip(todo, counted, strict=True):
        tokens[i] = n
        found = token_problems(queries[i], n, limits)
        if found:
            rows[i] = found
    if rows and (not fail_row or (part is None and len(rows) == len(queries))):
        offset = part.offset if part else 0
        problems = [f"{_name(offset + i, queries[i])}: {p}" for i in sorted(rows) for p in rows[i]]
        if fail_row:
            problems.insert(0, "every query of the batch is bad")
        raise InvalidBatch(problems)
    return Checked(
        prompt_tokens=tokens,
        max_tokens=[effective_max_tokens(q, limits) for q in queries],
        bad={i: "; ".join(p) for i, p in rows.items()},
        uncounted=uncounted,
    )


def cluster_problems(req: pb.AddClusterRequest) -> list[str]:
    """Problems of an AddCluster request, found before anything is written."""
    out: list[str] = []
    name = id_problem(req.name, "cluster name")
    if name:
        out.append(name)
    cap = req.capacity_tokens_per_s
    if not math.isfinite(cap) or cap < 0:
        out.append(f"capacity_tokens_per_s must be a finite number >= 0 (0: no hint), not {cap}")
    for key in ("max_query_tokens", "kv_budget_tokens"):
        if getattr(req, key) < 0:
            out.append(f"{key} must be >= 0 (0: no limit), not {getattr(req, key)}")
    if req.backend and not ID_RE.match(req.backend):
        out.append(f"backend must be {ALPHABET}")
    return out
