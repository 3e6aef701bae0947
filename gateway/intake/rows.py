"""The rows of a batch in background intake: how a validated query is stored in its intake list
(:class:`EncodedRows`, JSON per row), and what a row becomes when it lands: a queued query's
payload (:func:`payload`; :func:`queued_query` for a batch assigned at submission) or the result of a query failed at intake (:func:`failed_result`).

**Tenants apart.** Every payload carries its batch's ``cache_salt`` (:func:`tenant_salt`): a short hash
of the batch's owner (the client its token names; the HTTP front's own identity), which starts the
hash chain of the engine's prefix-cache keys, so two clients' identical prompts share no cached
prefix (and time to first token tells no client what another's prompts begin with). A batch without
an owner (a gateway without client tokens) and every batch of a gateway with ``--shared-prefix-cache``
get none: one shared cache. With one client the salt is one constant: the cache is shared as before.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

from gateway.checks.validation import Checked
from protos import fleetbatch_pb2 as pb
from workqueue import QueryResult, QueuedQuery

#: the field of a batch's hash that names its owner (gateway.batches.quota.OWNER_FIELD, read by the intake)
BATCH_OWNER_FIELD = "owner"

#: ``json.dumps(row, separators=(",", ":"))`` without building an encoder for every row
_compact = json.JSONEncoder(separators=(",", ":")).encode


class EncodedRows(Sequence[str]):
    """The batch's rows as JSON, one per query, encoded when a slice is read (the whole batch is
    never held as JSON at once): what enqueueing needs later, the validated limits and token counts."""

    def __init__(self, request: pb.SubmitBatchRequest, checked: Checked) -> None:
        self.request, self.checked = request, checked

    def __len__(self) -> int:
        return len(self.request.queries)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self._row(k) for k in range(*i.indices(len(self)))]
        return self._row(i if i >= 0 else len(self) + i)

    def _row(self, i: int) -> str:
        q, checked = self.request.queries[i], self.checked
        row = {"id": q.id, "prompt": q.prompt, "max_tokens": checked.max_tokens[i]}
        if i in checked.bad:
            row["bad"] = checked.bad[i]
        else:
            if i in checked.uncounted:  # counted by the intake, which fails it above its cap
                row["token_cap"] = checked.uncounted[i]
            else:
                row["prompt_tokens"] = checked.prompt_tokens[i]
            sampling = q.sampling
            row["temperature"] = sampling.temperature
            row["top_p"] = sampling.top_p or 1.0
            if sampling.HasField("seed"):
                row["seed"] = sampling.seed
            if q.HasField("forced_length"):
                row["forced_length"] = q.forced_length
            if q.metadata:
                row["metadata"] = dict(q.metadata)
            if q.openai_body:  # checked by validation (workqueue.openai_body.parse_body)
                row["openai_body"] = json.loads(q.openai_body)
        return _compact(row)


def encode_rows(request: pb.SubmitBatchRequest, checked: Checked) -> EncodedRows:
    """One JSON row per query (see :class:`EncodedRows`)."""
    return EncodedRows(request, checked)


def tenant_salt(owner: str | None, shared: bool = False) -> str:
    """The prefix-cache salt of a batch owned by ``owner`` (see the module docstring): 16 hex digits of a
    digest of the owner's name (the engine never sees the name, nor any token), "" without an owner or
    with ``shared`` (``--shared-prefix-cache``)."""
    if not owner or shared:
        return ""
    return hashlib.blake2b(owner.encode(), digest_size=8, person=b"fb-tenant").hexdigest()


def payload(batch_id: str, row: dict, predicted: float, cached: int = 0, salt: str = "") -> str:
    """The query's payload JSON, field for field ``asdict(QueuedQuery(...))`` (built directly: asdict's
    deep copies cost more than the rest of a chunk's bookkeeping)."""
    return json.dumps(
        {
            "batch_id": batch_id,
            "query_id": row["id"],
            "prompt": row["prompt"],
            "max_tokens": row["max_tokens"],
            "prompt_tokens": row["prompt_tokens"],
            "predicted_tokens": predicted,
            "temperature": row["temperature"],
            "top_p": row["top_p"],
            "seed": row.get("seed"),
            "forced_length": row.get("forced_length"),
            "metadata": row.get("metadata", {}),
            "cached_tokens": cached,
            "openai_body": row.get("openai_body"),
            "cache_salt": salt,
            "raw_predicted_tokens": row.get("raw_predicted"),
        }
    )


def queued_query(
    batch_id: str,
    q: pb.Query,
    max_tokens: int,
    prompt_tokens: int,
    predicted: float,
    cached: int,
    salt: str = "",
    raw_predicted: float | None = None,
) -> QueuedQuery:
    """The queued record of a validated query assigned at submission (the same fields as :func:`payload`)."""
    sampling = q.sampling
    return QueuedQuery(
        batch_id=batch_id,
        query_id=q.id,
        prompt=q.prompt,
        max_tokens=max_tokens,
        prompt_tokens=prompt_tokens,
        predicted_tokens=predicted,
        temperature=sampling.temperature,
        top_p=sampling.top_p or 1.0,
        seed=sampling.seed if sampling.HasField("seed") else None,
        forced_length=q.forced_length if q.HasField("forced_length") else None,
        metadata=dict(q.metadata),
        cached_tokens=cached,
        openai_body=json.loads(q.openai_body) if q.openai_body else None,
        cache_salt=salt,
        raw_predicted_tokens=raw_predicted,
    )


def failed_result(batch_id: str, query_id: str, why: str) -> str:
    """The result JSON of a query failed at intake (``why`` in its ``error``)."""
    return QueryResult(batch_id, query_id, finish_reason="error", error=why).to_json()
