"""The books of a ``loadgen chaos`` run: what the queue and the user see, and whether the run passed.

Over every gRPC batch of the run (the waves and the batches some faults submit):

* ``lost``: queries without a result, in Redis (and at the client, when its stream ended);
* ``duplicated``: result rows beyond one per query, in Redis;
* ``stuck``: queries not final when the run stopped waiting;
* ``wrongly_failed``: failed rows that could have run (any row but the deliberate misfits of
  :func:`load.chaos_load.legit_failure`), plus such error lines in the OpenAI files;

then ``invariant_violations`` (:func:`workqueue.invariants.check` on the quiet queue) and the
user's view of the OpenAI batches (:func:`load.chaos_openai.user_view`). :func:`verdict` lists
why a run failed: a count of :data:`CHECKED` above 0, fewer fault kinds than asked, or a
killed engine whose restart was not observed.
"""

from __future__ import annotations

from dataclasses import dataclass

from load.chaos_client import ResilientClient
from load.chaos_load import legit_failure
from workqueue import WorkQueue

#: the counts that must be 0 for a run to pass
CHECKED = (
    "lost",
    "duplicated",
    "stuck",
    "invariant_violations",
    "output_lines_missing",
    "output_lines_duplicated",
    "wrongly_failed",
    "openai_violations",
    "engines_not_restarted",
)
FAILED_REASONS = ("error", "cancelled", "abort")


@dataclass
class GrpcBatch:
    name: str
    batch_id: str
    ids: list[str]
    client: ResilientClient


def failed(row: dict) -> bool:
    """Whether a result row is a failure (today's rows: an error set or a failing finish reason)."""
    return bool(row.get("error")) or row.get("finish_reason") in FAILED_REASONS


def grpc_books(q: WorkQueue, batches: list[GrpcBatch]) -> dict:
    lost = duplicated = stuck = wrongly = 0
    failed_ids: list[str] = []
    for b in batches:
        info = q.batch(b.batch_id)
        rows = q.results(b.batch_id)
        have = {r["query_id"] for r in rows}
        if b.client.final:
            have &= set(b.client.results)
        lost += len(set(b.ids) - have)
        duplicated += len(rows) - len({r["query_id"] for r in rows})
        finished = (info.completed + info.failed + info.cancelled) if info else 0
        stuck += len(b.ids) - finished
        bad = [r for r in rows if failed(r) and not legit_failure(r["query_id"])]
        wrongly += len(bad)
        if bad:
            e = bad[0].get("error") or bad[0].get("finish_reason")
            failed_ids.append(f"{b.name}: {len(bad)} rows, e.g. {bad[0]['query_id']}: {e}")
    return {
        "lost": lost,
        "duplicated": duplicated,
        "stuck": stuck,
        "wrongly_failed_rows": wrongly,
        "wrongly_failed_examples": failed_ids[:10],
    }


def verdict(report: dict, asked: tuple[str, ...]) -> list[str]:
    """Why the run failed (empty: it passed)."""
    why = [f"{k} = {report[k]}" for k in CHECKED if report.get(k)]
    missing = [f for f in asked if not report["faults"].get(f)]
    if missing:
        why.append(f"faults not injected: {', '.join(missing)}")
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
    lines = [f"{'fault':<20} {'injected':>8} {'recovery s':>11}"]
    for f in kinds:
        rec = r["recovery_s"].get(f)
        lines.append(f"{f:<20} {r['faults'][f]:>8} {rec if rec is not None else '-':>11}")
    lines.append(", ".join(f"{k} {r[k]}" for k in CHECKED) + f" ({r['queries']} queries, {r['wall_s']} s)")
    lines.append("PASS" if r["ok"] else "FAIL: " + "; ".join(r["problems"]))
    return "\n".join(lines)
