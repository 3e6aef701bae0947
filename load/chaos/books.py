"""The books of a ``fleetbatch loadgen chaos`` run: what the queue and the user see, and whether the run passed.

Over every gRPC batch of the run (the waves and the batches some faults submit):

* ``lost``: queries without a result, in Redis (and at the client, when its stream ended);
* ``duplicated``: result rows beyond one per query, in Redis;
* ``stuck``: queries not final when the run stopped waiting (per batch, never below 0, so a
  batch that counts too many cannot hide one that counts too few);
* ``overcounted``: finished queries a batch counts beyond its size;
* ``count_mismatches``: batches whose ``completed`` / ``failed`` / ``cancelled`` differ from
  their result rows counted by :func:`workqueue.outcome` (what gRPC reports against the rows);
* ``wrongly_failed``: rows without an answer (``not outcome(...).answered``) that could have
  run: any row but the deliberate misfits failed with their own error
  (:func:`load.chaos.waves.legit_failure`), plus such error lines in the OpenAI files;

then ``invariant_violations`` (:func:`workqueue.invariants.check` on the quiet queue) and the
user's view of the OpenAI batches (:func:`load.chaos.openai_view.user_view`). :func:`verdict` lists
why a run failed: a count of :data:`CHECKED` above 0, a fault that did not bite, fewer fault
kinds than asked, a killed engine whose restart was not observed, or a client that met a
permanent error.
"""

from __future__ import annotations

from dataclasses import dataclass

from load.chaos.client import ResilientClient
from load.chaos.faults_wide import cancellable
from load.chaos.waves import legit_failure
from workqueue import QueryState, WorkQueue, outcome

#: the counts that must be 0 for a run to pass
CHECKED = (
    "lost",
    "duplicated",
    "stuck",
    "overcounted",
    "count_mismatches",
    "invariant_violations",
    "output_lines_missing",
    "output_lines_duplicated",
    "wrongly_failed",
    "openai_violations",
    "engines_not_restarted",
)


@dataclass
class GrpcBatch:
    name: str
    batch_id: str
    ids: list[str]
    client: ResilientClient | None  # None: a batch the run wrote straight to Redis (``large_cancel``)


def row_state(row: dict) -> QueryState:
    """How a result row counts in its batch (the one rule: :func:`workqueue.outcome`)."""
    return outcome(row.get("finish_reason"), row.get("error")).state


def grpc_books(q: WorkQueue, batches: list[GrpcBatch]) -> dict:
    lost = duplicated = stuck = over = wrongly = 0
    failed_ids: list[str] = []
    mismatches: list[str] = []
    for b in batches:
        info = q.batch(b.batch_id)
        rows = q.results(b.batch_id)
        first: dict[str, dict] = {}
        for r in rows:
            first.setdefault(r["query_id"], r)
        have = set(first)
        if b.client is not None and b.client.final:
            have &= set(b.client.results)
        lost += len(set(b.ids) - have)
        duplicated += len(rows) - len(first)
        counted = (info.completed, info.failed, info.cancelled) if info else (0, 0, 0)
        stuck += max(0, len(b.ids) - sum(counted))
        over += max(0, sum(counted) - len(b.ids))
        states = [row_state(r) for r in first.values()]
        by_rows = tuple(
            states.count(s) for s in (QueryState.COMPLETED, QueryState.FAILED, QueryState.CANCELLED)
        )
        if by_rows != counted:
            mismatches.append(
                f"{b.name}: (completed, failed, cancelled) counted {counted}, rows hold {by_rows}"
            )
        bad = [
            r
            for r in first.values()
            if not outcome(r.get("finish_reason"), r.get("error")).answered
            and not legit_failure(r["query_id"], r.get("error"))
            and not (cancellable(r["query_id"]) and row_state(r) == QueryState.CANCELLED)
        ]
        wrongly += len(bad)
        if bad:
            e = bad[0].get("error") or bad[0].get("finish_reason")
            failed_ids.append(f"{b.name}: {len(bad)} rows, e.g. {bad[0]['query_id']}: {e}")
    return {
        "lost": lost,
        "duplicated": duplicated,
        "stuck": stuck,
        "overcounted": over,
        "count_mismatches": len(mismatches),
        "count_problems": mismatches[:10],
        "wrongly_failed_rows": wrongly,
        "wrongly_failed_examples": failed_ids[:10],
    }


def verdict(report: dict, asked: tuple[str, ...]) -> list[str]:
    """Why the run failed (empty: it passed). ``faults`` counts only faults that bit;
    ``fault_misses`` says why each of the others did not; ``client_failures`` are permanent errors."""
    why = [f"{k} = {report[k]}" for k in CHECKED if report.get(k)]
    why += [f"{f} did not bite: {m}" for f, m in report.get("fault_misses", {}).items()]
    missing = [f for f in asked if not report["faults"].get(f)]
    if missing:
        why.append(
            f"faults that did not bite: {', '.join(missing)} ({len(asked) - len(missing)} of {len(asked)} kinds)"
        )
    why += [f"client: {e}" for e in report.get("client_failures", [])]
    return why


def merged_counts(dicts) -> dict[str, int]:
    """Counts per key, summed over ``dicts`` (the clients' errors by status code)."""
    out: dict[str, int] = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out


def format_report(r: dict, kinds: tuple[str, ...]) -> str:
    """The human table printed before the JSON line: faults, recovery, the counts, the verdict."""
    lines = [f"{'fault':<20} {'bit':>8} {'recovery s':>11}"]
    for f in kinds:
        rec = r["recovery_s"].get(f)
        lines.append(f"{f:<20} {r['faults'][f]:>8} {rec if rec is not None else '-':>11}")
    lines.append(", ".join(f"{k} {r[k]}" for k in CHECKED) + f" ({r['queries']} queries, {r['wall_s']} s)")
    lines.append("PASS" if r["ok"] else "FAIL: " + "; ".join(r["problems"]))
    return "\n".join(lines)
