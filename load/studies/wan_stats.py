"""What ``fleetbatch loadgen wan`` reads back from its run directories: each cluster's device-busy fraction, its
Redis round trips per engine step, and the summary across round-trip times.

A cluster's **span** runs from its first claim (the earliest ``started_at`` among its results)
to its last finish; its **device-busy fraction** is the seconds its engine spent in steps within
that span, divided by the span. Busy seconds, steps and round trips are the differences of the
engine's cumulative heartbeat figures (``device_busy_s``, ``steps``, ``redis_round_trips``, as
:class:`load.reports.runrecord.Sampler` recorded them) between the last sample taken before the batch
was submitted and the first heartbeat sent at or after the cluster's last finish (so idle time
after the batch barely counts). An engine that does not report ``device_busy_s`` gets an
estimate from the cost model instead: its device steps (``device_steps``) x the per-pass
overhead, plus its results' prompt tokens x the per-token prefill cost and completion tokens x
the per-query decode cost, divided by its speed (``busy_source`` says which was used). Without
``redis_round_trips`` the round trips per step are None.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

from engines.device import StepCost
from load.reports.runrecord import META, RESULTS, TIMESERIES, read_jsonl

HEARTBEAT, COST_MODEL = "heartbeat", "cost_model"


def _timing(r: dict, key: str) -> float:
    return float((r.get("timings") or {}).get(key) or 0.0)


def _delta(first: dict, last: dict, key: str) -> float | None:
    if last.get(key) is None:
        return None
    return max(0.0, float(last[key]) - float(first.get(key) or 0.0))


def _window(rows: list[dict], start: float, end: float) -> tuple[dict, dict]:
    """The sample taken last at or before ``start`` (else the first) and the first sample whose
    heartbeat was sent at or after ``end`` (else the last)."""
    rows = sorted(rows, key=lambda r: r["t"])
    first = ([r for r in rows if r["t"] <= start] or rows[:1])[-1]
    last = next((r for r in rows if (r.get("hb_t") or r["t"]) >= end), rows[-1])
    return first, last


def cluster_figures(run_dir: Path) -> dict[str, dict]:
    """Per cluster of a run: span, busy seconds (and their source), steps, round trips, and the
    device-busy fraction and round trips per step they give."""
    results = read_jsonl(run_dir / RESULTS)
    series = read_jsonl(run_dir / TIMESERIES)
    meta = json.loads((run_dir / META).read_text()) if (run_dir / META).exists() else {}
    if not results:
        raise FileNotFoundError(f"{run_dir / RESULTS}: no results")
    t0 = min(_timing(r, "enqueued_at") for r in results)
    by_cluster: dict[str, list[dict]] = defaultdict(list)
    for r in results:
        by_cluster[r.get("cluster") or "-"].append(r)
    samples: dict[str, list[dict]] = defaultdict(list)
    for s in series:
        samples[s["cluster"]].append(s)
    names = meta.get("clusters") or sorted(by_cluster)
    speeds = dict(zip(names, meta.get("fleet") or [], strict=False))
    cost = StepCost.parse(meta["device_cost_ms"]) if meta.get("device_cost_ms") else None
    out = {}
    for name in sorted(by_cluster):
        rs = by_cluster[name]
        start = min(_timing(r, "started_at") for r in rs)
        finish = max(_timing(r, "finished_at") for r in rs)
        span = max(finish - start, 1e-9)
        busy = steps = trips = None
        source = None
        if samples.get(name):
            first, last = _window(samples[name], t0, finish)
            busy, trips = _delta(first, last, "device_busy_s"), _delta(first, last, "redis_round_trips")
            steps = _delta(first, last, "steps")
            if steps is None:
                steps = _delta(first, last, "device_steps")
            source = HEARTBEAT if busy is not None else None
            if busy is None and cost is not None and steps is not None:
                prompt = sum(int(r.get("prompt_tokens") or 0) for r in rs)
                done = sum(int(r.get("completion_tokens") or 0) for r in rs)
                busy = (
                    steps * cost.step_overhead_s
                    + prompt * cost.prefill_per_token_s
                    + done * cost.decode_per_seq_s
                ) * float(speeds.get(name, 1.0))  # a speed-s cluster's device is s times slower
                source = COST_MODEL
        out[name] = {
            "queries": len(rs),
            "span_s": round(span, 3),
            "finished_after_s": round(finish - t0, 3),
            "device_busy_s": None if busy is None else round(busy, 3),
            "busy_source": source,
            "steps": None if steps is None else int(steps),
            "redis_round_trips": None if trips is None else int(trips),
            "utilization": None if busy is None else round(min(busy / span, 1.0), 4),
            "redis_round_trips_per_step": round(trips / steps, 3) if trips is not None and steps else None,
        }
    return out


def makespan_s(run_dir: Path) -> float:
    """First enqueue to last finish of the run's results."""
    results = read_jsonl(run_dir / RESULTS)
    return max(_timing(r, "finished_at") for r in results) - min(_timing(r, "enqueued_at") for r in results)


def rtt_key(one_way_ms: float) -> str:
    """The JSON key of a round-trip time: twice the one-way delay, in ms (``"100"`` for 50 ms each way)."""
    return f"{2 * one_way_ms:g}"


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None


def summarise(runs: dict[str, Path]) -> dict:
    """The summary of runs keyed by round-trip time (:func:`rtt_key`, ``"0"`` the baseline)."""
    figures = {rtt: cluster_figures(d) for rtt, d in runs.items()}
    makespans = {rtt: round(makespan_s(d), 3) for rtt, d in runs.items()}
    util: dict[str, float | None] = {}
    per_step: dict[str, float | None] = {}
    by_cluster: dict[str, dict[str, float | None]] = defaultdict(dict)
    sources: dict[str, list[str]] = {}
    for rtt, clusters in figures.items():
        values = [c["utilization"] for c in clusters.values() if c["utilization"] is not None]
        util[rtt] = round(statistics.fmean(values), 4) if values else None
        trips = [c["redis_round_trips"] for c in clusters.values() if c["redis_round_trips"] is not None]
        steps = sum(c["steps"] or 0 for c in clusters.values())
        per_step[rtt] = round(sum(trips) / steps, 3) if trips and steps else None
        sources[rtt] = sorted({c["busy_source"] for c in clusters.values() if c["busy_source"]})
        for name, c in clusters.items():
            by_cluster[name][rtt] = c["utilization"]
    base = "0"
    return {
        "utilization_by_rtt_ms": util,
        "utilization_by_cluster": dict(sorted(by_cluster.items())),
        "makespan_by_rtt_ms": makespans,
        "makespan_ratio_by_rtt_ms": {rtt: _ratio(m, makespans.get(base)) for rtt, m in makespans.items()},
        "makespan_ratio_at_100ms": _ratio(makespans.get("100"), makespans.get(base)),
        "utilization_at_100ms": _ratio(util.get("100"), util.get(base)),
        "redis_round_trips_per_step": per_step,
        "busy_source_by_rtt_ms": sources,
        "clusters_by_rtt_ms": figures,
    }
