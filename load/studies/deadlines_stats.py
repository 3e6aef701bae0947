"""``fleetbatch loadgen deadlines``' scenario and figures: the batches' windows from the simulator's makespan, which
windows each order met, the ETA's error at 25 % and 50 % of a batch's tokens, the expired batch's
files, and the simulator's replay of each run (:mod:`load.studies.deadlines`)."""

from __future__ import annotations

import json
import statistics
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from load.reports.runrecord import read_jsonl
from load.studies.study import sim_cli
from load.workload import WorkItem

#: (name, share of the rows, submitted at +s, window in multiples of the whole workload's makespan T)
SCENARIO = (("bulk", 0.60, 0.0, 1.6), ("urgent", 0.25, 2.0, 0.65), ("steady", 0.15, 4.0, 1.2))
EXPIRY_SHARE, EXPIRY_WINDOW = 0.5, 0.2  # the expiry run: half the rows, a window of 0.2 T


@dataclass(frozen=True)
class BatchPlan:
    name: str
    rows: list[int]  # indices into the workload
    at_s: float  # submitted this long after the first
    window_s: float


@dataclass(frozen=True)
class Plan:
    makespan_s: float  # T: the simulator's makespan of the whole workload on the fleet
    batches: list[BatchPlan]
    expiry_rows: list[int]
    expiry_window_s: float


def scenario_plan(items: list[WorkItem], speeds, args, out: Path) -> Plan:
    """The batches of :data:`SCENARIO` over ``items`` (in order), their windows from the simulator's makespan."""
    from localmodels import default_tokenizer

    tok = default_tokenizer()
    out.mkdir(parents=True, exist_ok=True)
    work = {
        "prompt_tokens": [max(1, len(tok(it.prompt)["input_ids"])) for it in items],
        "true_tokens": [max(1, int(it.forced_length or it.max_tokens)) for it in items],
    }
    (out / "workload.json").write_text(json.dumps(work))
    makespan = sim_cli("deadlines", *_fleet(speeds, args), "--workload", str(out / "workload.json")).get(
        "makespan_s"
    )
    if not makespan:
        raise ValueError("the simulator could not estimate the scenario's makespan (see the warning above)")
    n, batches, start = len(items), [], 0
    for k, (name, share, at, window) in enumerate(SCENARIO):
        count = n - start if k == len(SCENARIO) - 1 else round(n * share)
        batches.append(BatchPlan(name, list(range(start, start + count)), at, window * makespan))
        start += count
    expiry = list(range(round(n * EXPIRY_SHARE)))
    return Plan(makespan, batches, expiry, EXPIRY_WINDOW * makespan)


def _fleet(speeds, args) -> list[str]:
    return [
        "--device-cost",
        args.step_cost,
        "--speeds",
        ",".join(f"{s:g}" for s in speeds),
        "--max-running",
        str(args.max_running),
    ]


def met(batches: dict[str, dict]) -> list[str]:
    """The batches that completed within their window."""
    return sorted(
        n for n, b in batches.items() if b["status"] == "COMPLETED" and 0 < b["completed_at"] <= b["deadline"]
    )


def eta_errors(etas: list[dict], batches: dict[str, dict], at: float) -> dict[str, float]:
    """Per batch, |predicted - actual finish| / (actual finish - submission), read when ``at`` of its predicted
    tokens were done (its first read at or past that point; a batch that never gets there has none)."""
    out = {}
    for name, b in batches.items():
        if b["status"] != "COMPLETED":
            continue
        for e in sorted((e for e in etas if e["batch"] == name), key=lambda e: e["t"]):
            if e["predicted_tokens"] > 0 and e["done_predicted_tokens"] >= at * e["predicted_tokens"]:
                span = b["completed_at"] - b["submitted_at"]
                if e["predicted_finish_at"] > 0 and span > 0:
                    out[name] = round(abs(e["predicted_finish_at"] - b["completed_at"]) / span, 4)
                break
    return out


def expired_rows_problems(batch, custom_ids: list[str], output: list[dict], errors: list[dict]) -> list[str]:
    """What is wrong with an expired batch's files: every row exactly once in the output or the error file, the
    unfinished ones ``batch_expired``, counts that add up (empty: nothing). How many finished before the window
    ended is reported apart (``expiry_rows``): it depends on the machine, not on correctness."""
    problems = [] if batch.status == "expired" else [f"the batch ended {batch.status}, not expired"]
    seen = Counter(x.get("custom_id") for x in output + errors)
    if missing := [c for c in custom_ids if seen[c] == 0]:
        problems.append(f"{len(missing)} rows in neither file, e.g. {missing[:3]}")
    if twice := [c for c, k in seen.items() if k > 1]:
        problems.append(f"{len(twice)} rows more than once, e.g. {twice[:3]}")
    if extra := set(seen) - set(custom_ids):
        problems.append(f"{len(extra)} rows not in the input")
    codes = Counter((x.get("error") or {}).get("code") for x in errors)
    if set(codes) - {"batch_expired"}:
        problems.append(f"error codes other than batch_expired: {dict(codes)}")
    counts = batch.request_counts
    if counts is None or (counts.total, counts.completed) != (len(custom_ids), len(output)):
        problems.append(f"request_counts {counts} do not match the files")
    return problems


def _median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 4) if xs else None


def summarise(out: Path, orders: list[str], plan: Plan, args, expiry: list[str] | None) -> dict:
    result: dict = {
        "command": "deadlines",
        "queries": sum(len(b.rows) for b in plan.batches),
        "makespan_estimate_s": round(plan.makespan_s, 2),
        "windows_s": {b.name: round(b.window_s, 1) for b in plan.batches},
    }
    errors: dict[float, list[float]] = {0.25: [], 0.5: []}
    sim_error: list[float] = []
    for order in orders:
        meta = json.loads((out / order / "meta.json").read_text())
        batches = meta["batches"]
        result[f"deadlines_met_{order}"] = len(met(batches))
        result[f"met_{order}"] = met(batches)
        result[f"finish_s_{order}"] = {
            n: round(b["completed_at"] - b["submitted_at"], 2) for n, b in batches.items()
        }
        etas = read_jsonl(out / order / "etas.jsonl")
        for at, xs in errors.items():
            per = eta_errors(etas, batches, at)
            result[f"eta_error_{order}_at_{round(at * 100)}pct"] = per
            xs.extend(per.values())
        sim = (sim_cli("deadlines", *_fleet(meta["fleet"], args), str(out / order)).get("replays") or {}).get(
            str(out / order)
        ) or {n: None for n in batches}
        first = min(b["submitted_at"] for b in batches.values())
        finish = {n: None if f is None else first + f for n, f in sim.items()}
        result[f"sim_deadlines_met_{order}"] = sum(
            1 for n, f in finish.items() if f is not None and f <= batches[n]["deadline"]
        )
        for n, b in batches.items():
            if b["status"] == "COMPLETED" and finish[n] is not None:
                sim_error.append(
                    abs(finish[n] - b["completed_at"]) / max(b["completed_at"] - b["submitted_at"], 1e-9)
                )
    if {"edf", "fifo"} <= set(orders):
        edf, fifo = set(result["met_edf"]), set(result["met_fifo"])
        result["met_by_edf_missed_by_fifo"] = sorted(edf - fifo)
        result["missed_by_edf_met_by_fifo"] = sorted(fifo - edf)
    result["eta_error_at_25pct"] = _median(errors[0.25])
    result["eta_error_at_50pct"] = _median(errors[0.5])
    result["sim_finish_error"] = round(statistics.fmean(sim_error), 4) if sim_error else None
    result["expired_rows_correct"] = None if expiry is None else not expiry
    if expiry:
        result["expiry_problems"] = expiry
    return result
