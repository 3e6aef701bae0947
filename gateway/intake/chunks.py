"""One chunk of a batch in background intake, from its stored rows to the rows that land.

A chunk's rows (JSON from the intake list, :mod:`gateway.intake.rows`) are counted (rows staged
without a token count), predicted (:func:`predict_chunk`), placed (:mod:`gateway.assign.placement`:
now, later or never) and turned into what lands (:func:`landing`): a queued query's payload,
or the result of a row failed at intake.

**A chunk that waits** for a cluster not alive now (:class:`~gateway.assign.placement.IntakeWaits`) is
kept, counted and predicted, in :class:`Waiting`: one chunk per waiting batch, so each poll of
the wait only places it again instead of reading, decoding, counting and predicting it anew.
It is used only while it is still its batch's head (the same batch, the same cursor) and is
dropped when it lands, when its batch is cancelled, and when its batch leaves intake
(:meth:`Waiting.prune`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from gateway.assign.calibrated import LengthEstimates
from gateway.assign.estimates import charged_tokens
from gateway.assign.policies import QueryLoad
from gateway.assign.prefixes import Prefix, prefixes_of
from gateway.intake.rows import failed_result, payload
from workqueue.keys import gid

#: what one chunk lands, row for row: ``(gid, payload or result JSON, predicted tokens, cluster or "")``
Landing = list[tuple[str, str, float, str]]


@dataclass(frozen=True)
class Chunk:
    """A chunk's rows (token counts filled in) from index ``cursor`` of its batch, and the loads
    of its good rows (rows without ``bad``), in order."""

    cursor: int
    rows: list[dict]
    loads: list[QueryLoad]


def count_rows(rows: list[dict], count_tokens: Callable[[list[str]], list[int]] | None) -> None:
    """Count the tokens of rows staged uncounted (``token_cap``); one above its cap turns bad."""
    todo = [r for r in rows if "prompt_tokens" not in r and "bad" not in r]
    if not todo:
        return
    if count_tokens is None:
        raise RuntimeError("rows staged without token counts need an intake with count_tokens")
    for r, n in zip(todo, count_tokens([r["prompt"] for r in todo]), strict=True):
        r["prompt_tokens"] = n
        if n > r["token_cap"]:  # the bound is an upper bound: this is a guard, not a path
            r["bad"] = f"prompt has {n} tokens; its limit is {r['token_cap']}"


def predict_chunk(
    cursor: int,
    rows: list[dict],
    predict_tokens: Callable[[list[str]], LengthEstimates | list[float]],
    count_tokens: Callable[[list[str]], list[int]] | None,
    counter: ThreadPoolExecutor | None = None,
    find_prefixes: Callable[[list[str], list[int]], list[Prefix]] | None = None,
) -> Chunk:
    """Count and predict a chunk's rows (the tokenizer in ``counter`` beside the predictor), and find
    their prefix groups (:mod:`gateway.assign.prefixes`)."""
    fresh = [r for r in rows if "bad" not in r]
    counting = counter.submit(count_rows, rows, count_tokens) if counter else None
    if counting is None:
        count_rows(rows, count_tokens)
    estimates = LengthEstimates.of(predict_tokens([r["prompt"] for r in fresh]) if fresh else [])
    for r, raw in zip(fresh, estimates.raw, strict=True):
        r["raw_predicted"] = raw  # the payload's raw_predicted_tokens (gateway.assign.calibrated)
    predicted = estimates.tokens
    if counting is not None:
        counting.result()
    good = [r for r in rows if "bad" not in r]
    if len(good) != len(fresh):
        predicted = [p for r, p in zip(fresh, predicted, strict=True) if "bad" not in r]
    shared = prefixes_of(find_prefixes, [r["prompt"] for r in good], [r["prompt_tokens"] for r in good])
    loads = [
        QueryLoad(r["id"], r["prompt_tokens"], float(min(p, r["max_tokens"])), *prefix)
        for r, p, prefix in zip(good, predicted, shared, strict=True)
    ]
    return Chunk(cursor, rows, loads)


def landing(
    batch_id: str,
    chunk: Chunk,
    placed: dict[str, tuple[str | None, str]],
    order: Sequence[int] | None = None,
    part: int = 0,
    charges: dict[str, float] | None = None,
    salt: str = "",
) -> Landing:
    """What the chunk lands, given each good row's ``(cluster, "")`` or ``(None, why it fails)``.

    With ``order`` (indices into ``chunk.loads``: the policy's queue order), the queued rows of each
    ``part`` consecutive rows (the rows one script call lands) go in that order, its failed rows
    first: a call lands exactly the rows of its slice of the intake list, which it then trims by
    count, so a chunk landed in part resumes at the right row. ``charges``: what a row adds to its
    cluster's ``pending`` (by key; default its prompt + predicted tokens): a prefix group's shared
    prompt once per cluster. ``salt``: the batch's prefix-cache salt (:func:`gateway.intake.rows.tenant_salt`)."""
    out: list[tuple[tuple[int, int], tuple]] = []  # ((part, rank in the queue order), what lands)
    rank = {chunk.loads[j].key: r for r, j in enumerate(order)} if order is not None else {}
    loads = iter(chunk.loads)
    for pos, r in enumerate(chunk.rows):
        g = gid(batch_id, r["id"])
        window = pos // part if part > 0 else 0
        if "bad" in r:
            out.append(
                ((window, -1), (g, failed_result(batch_id, r["id"], f"invalid query: {r['bad']}"), 0.0, ""))
            )
            continue
        load = next(loads)
        cluster, error = placed[load.key]
        if cluster is None:
            out.append(((window, -1), (g, failed_result(batch_id, r["id"], error), 0.0, "")))
        else:
            charge = load.total_tokens if charges is None else charges[load.key]
            cached = round(load.total_tokens - charge)
            land = (g, payload(batch_id, r, load.predicted_tokens, cached, salt), charge, cluster)
            out.append(((window, rank.get(load.key, pos)), land))
    if order is not None:
        out.sort(key=lambda x: x[0])  # stable
    return [land for _, land in out]


def charges_of(
    loads: Sequence[QueryLoad], placed: dict[str, tuple[str | None, str]], order: Sequence[int] | None
):
    """Each placed row's charge (:func:`gateway.assign.prefix_policy.charged_tokens`) in the queue order, by key;
    None when no row has a prefix group (every row is charged its prompt + predicted tokens)."""
    if not any(q.prefix_group is not None for q in loads):
        return None
    ranked = [loads[j] for j in (order if order is not None else range(len(loads)))]
    kept = [q for q in ranked if placed[q.key][0] is not None]
    return dict(
        zip((q.key for q in kept), charged_tokens(kept, [placed[q.key][0] for q in kept]), strict=True)
    )


def cancelled(batch_id: str, rows: list[dict]) -> Landing:
    """What a chunk of a cancelled batch lands: its rows finished as cancelled, none queued."""
    return [(gid(batch_id, r["id"]), "", 0.0, "") for r in rows]


class Waiting:
    """The chunk each waiting batch waits with, counted and predicted (see the module docstring)."""

    def __init__(self) -> None:
        self._chunks: dict[str, tuple[str, Chunk]] = {}

    def __len__(self) -> int:
        return len(self._chunks)

    def keep(self, batch_id: str, ident: str, chunk: Chunk) -> None:
        """Keep ``chunk`` for the batch ``batch_id`` created as ``ident`` (its ``created_at``)."""
        self._chunks[batch_id] = (ident, chunk)

    def get(self, batch_id: str, ident: str, cursor: int) -> Chunk | None:
        """The kept chunk if it is still the head of this batch (else it is dropped)."""
        kept = self._chunks.get(batch_id)
        if kept is None:
            return None
        if kept[0] != ident or kept[1].cursor != cursor:
            del self._chunks[batch_id]
            return None
        return kept[1]

    def drop(self, batch_id: str) -> None:
        self._chunks.pop(batch_id, None)

    def prune(self, live: Collection[str]) -> None:
        """Drop the chunks of batches not in ``live`` (they left intake, or another replica has them)."""
        for b in [b for b in self._chunks if b not in live]:
            del self._chunks[b]
