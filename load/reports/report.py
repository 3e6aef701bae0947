"""``fleetbatch loadgen report RUN``: throughput, makespan, tokens per cluster (predicted against actual), the
completion-time CDF, cumulative KV, and MICO-style plots, from a run directory (:mod:`load.reports.runrecord`).

Plots (PNG, next to the data): ``kv.png`` -- KV-cache tokens per cluster over time (the mean
KV each engine held between two samples, from its cumulative KV token-seconds, so static
batches that hold KV for a whole ``generate`` call show as they are); ``finished.png`` --
cumulative finished queries per cluster over time; ``cdf.png`` -- completion-time CDF.
"""

from __future__ import annotations

import itertools
import json
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from load.reports.layout import plan_rows  # noqa: E402
from load.reports.layout_plot import draw_layout  # noqa: E402
from load.reports.runrecord import META, RESULTS, TIMESERIES, read_jsonl  # noqa: E402

REPORT = "report.json"


def _percentiles(sorted_s: list[float]) -> dict[str, float]:
    n = len(sorted_s)
    return {f"p{p}": round(sorted_s[min(n - 1, int(p / 100 * n))], 3) for p in (50, 90, 99)}


def _t(r: dict, key: str) -> float:
    return float((r.get("timings") or {}).get(key) or 0.0)


def kv_series(rows: list[dict], t0: float) -> dict[str, tuple[list[float], list[float]]]:
    """Per cluster: heartbeat times (s after ``t0``) and the mean KV tokens held since the previous
    heartbeat (from the engine's cumulative KV token-seconds; samples of one heartbeat count once)."""
    by: dict[str, dict[float, float]] = defaultdict(dict)
    for r in rows:
        by[r["cluster"]][r.get("hb_t") or r["t"]] = r["kv_token_seconds"]
    out = {}
    for c, beats in sorted(by.items()):
        times = sorted(beats)
        ts, kv = [], []
        for a, b in itertools.pairwise(times):
            ts.append(b - t0)
            kv.append(max(0.0, (beats[b] - beats[a]) / (b - a)))
        out[c] = (ts, kv)
    return out


def cumulative_kv(rows: list[dict], start: float, end: float) -> dict[str, float]:
    """KV token-seconds each cluster's engine accumulated between ``start`` and ``end`` (wall clock)."""
    by: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by[r["cluster"]].append(r)
    out = {}
    for c, rs in by.items():
        rs.sort(key=lambda r: r["t"])
        before = [r for r in rs if r["t"] <= start] or rs[:1]
        out[c] = max(0.0, rs[-1]["kv_token_seconds"] - before[-1]["kv_token_seconds"])
    return out


def overrun_fraction(rows: list[dict]) -> float | None:
    """Of the emulated devices' steps (``--device-cost``), the fraction whose real compute outlasted the
    modelled time, from each cluster's last sample; None when no engine emulated a device that way."""
    last: dict[str, dict] = {}
    for r in rows:
        last[r["cluster"]] = r
    steps = sum(int(r.get("device_steps") or 0) for r in last.values())
    if not steps:
        return None
    return round(sum(int(r.get("device_overrun_steps") or 0) for r in last.values()) / steps, 4)


def finish_spread(results: list[dict]) -> tuple[dict[str, float], float | None]:
    """When each cluster finished (its last result's ``finished_at``, in s after the first enqueue) and
    the spread: the last cluster's finish minus the first's, over the makespan (0: all finished together;
    None with fewer than two clusters). Rows without a cluster (never run) count for no cluster."""
    if not results:
        return {}, None
    t0 = min(_t(r, "enqueued_at") for r in results)
    makespan = max(max(_t(r, "finished_at") for r in results) - t0, 1e-9)
    last: dict[str, float] = {}
    for r in results:
        if r.get("cluster"):
            last[r["cluster"]] = max(last.get(r["cluster"], t0), _t(r, "finished_at"))
    by = {c: round(t - t0, 3) for c, t in sorted(last.items())}
    if len(by) < 2:
        return by, None
    return by, round((max(last.values()) - min(last.values())) / makespan, 4)


def build_report(run_dir: str | Path, plots: bool = True) -> dict:
    run = Path(run_dir)
    results = read_jsonl(run / RESULTS)
    if not results:
        raise FileNotFoundError(f"{run / RESULTS}: no results to report on")
    meta = json.loads((run / META).read_text()) if (run / META).exists() else {}
    series = read_jsonl(run / TIMESERIES)
    t0 = min(_t(r, "enqueued_at") for r in results)
    end = max(_t(r, "finished_at") for r in results)
    makespan = max(end - t0, 1e-9)
    done = sorted(_t(r, "finished_at") - t0 for r in results)
    waited = sorted(_t(r, "finished_at") - _t(r, "enqueued_at") for r in results)
    per: dict[str, dict] = defaultdict(
        lambda: {"queries": 0, "predicted_tokens": 0.0, "actual_tokens": 0, "last_finish": t0}
    )
    for r in results:
        c = per[r.get("cluster") or "-"]
        c["queries"] += 1
        c["last_finish"] = max(c["last_finish"], _t(r, "finished_at"))
        c["predicted_tokens"] += float(r.get("predicted_tokens") or 0.0)
        c["actual_tokens"] += int(r.get("completion_tokens") or 0)
    tokens = sum(c["actual_tokens"] for c in per.values())
    kv = cumulative_kv(series, t0, end) if series else {}
    finish_by_cluster, spread = finish_spread(results)
    report = {
        "run": str(run),
        **{k: meta[k] for k in ("policy", "backend", "fleet", "batch_id") if k in meta},
        "queries": len(results),
        "makespan_s": round(makespan, 3),
        "completion_tokens": tokens,
        "tokens_per_s": round(tokens / makespan, 2),
        "completion_s": _percentiles(done),
        "latency_s": _percentiles(waited),  # each query's own: finished minus enqueued
        "cumulative_kv_token_s": round(sum(kv.values()), 1),
        "device_overrun_fraction": overrun_fraction(series),
        "finish_by_cluster": finish_by_cluster,  # s after the first enqueue
        "finish_spread": spread,  # (last cluster's finish - first's) / makespan; None: one cluster
        "clusters": {
            name: {
                "queries": c["queries"],
                "predicted_tokens": round(c["predicted_tokens"], 1),
                "actual_tokens": c["actual_tokens"],
                "kv_token_s": round(kv.get(name, 0.0), 1),
                "finished_after_s": round(c["last_finish"] - t0, 3),
                "saturated_tps": saturated_tps(series, name),
            }
            for name, c in sorted(per.items())
        },
    }
    layouts = (meta.get("planned") or {}).get("clusters")
    if layouts:  # a planned fleet's run: each cluster's plan against what it measured
        report["plans"] = plan_rows(layouts, report)
    if plots:
        report["plots"] = draw(run, results, series, t0)
        if layouts:
            report["plots"].append(draw_layout(run / "layout.png", report["plans"]))
    (run / REPORT).write_text(json.dumps(report, indent=2))
    return report


def saturated_tps(series: list[dict], cluster: str) -> float | None:
    """The median of the engine's own tokens/s over the samples where work waited in its queue (so it
    ran as fast as it could): what the cluster sustains, without the ramp at the start and the tail."""
    rates = sorted(
        float(r["measured_tps"])
        for r in series
        if r.get("cluster") == cluster and r.get("queue_length", 0) > 0 and r.get("measured_tps")
    )
    return round(rates[len(rates) // 2], 2) if rates else None


def draw(run: Path, results: list[dict], series: list[dict], t0: float) -> list[str]:
    """The three PNGs (``kv.png`` only when there is a time series); returns their paths."""
    paths = []
    if series:
        kv = {
            c: (ts, v) for c, (ts, v) in kv_series(series, t0).items()
        }  # each value: the mean since the last sample
        paths.append(
            _plot(run / "kv.png", f"KV cache per cluster: {run.name}", "KV-cache tokens held", kv, "pre")
        )
    by: dict[str, list[float]] = defaultdict(list)
    for r in results:
        by[r.get("cluster") or "-"].append(_t(r, "finished_at") - t0)
    finished = {c: ([0.0, *sorted(ts)], list(range(len(ts) + 1))) for c, ts in sorted(by.items())}
    paths.append(
        _plot(run / "finished.png", f"Finished queries per cluster: {run.name}", "finished queries", finished)
    )
    done = sorted(t for ts in by.values() for t in ts)
    cdf = {"": (done, [(i + 1) / len(done) for i in range(len(done))])}
    paths.append(_plot(run / "cdf.png", f"Completion-time CDF: {run.name}", "fraction of queries", cdf))
    return paths


def _plot(path: Path, title: str, ylabel: str, lines: dict, where: str = "post") -> str:
    """Step lines (label -> (x, y)) against seconds since submit, saved as a PNG."""
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for label, (x, y) in lines.items():
        ax.step(x, y, where=where, label=label or None, linewidth=1.2)
    ax.set(xlabel="seconds since submit", ylabel=ylabel, title=title)
    if any(lines):
        ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def format_report(r: dict) -> str:
    lines = [
        f"{r['run']}: {r['queries']} queries, makespan {r['makespan_s']} s, {r['tokens_per_s']} tokens/s, "
        f"completion p50/p90/p99 {r['completion_s']['p50']}/{r['completion_s']['p90']}/{r['completion_s']['p99']} s, "
        f"latency p50/p90 {r['latency_s']['p50']}/{r['latency_s']['p90']} s, "
        f"cumulative KV {r['cumulative_kv_token_s']} token-s"
        + (
            f", {r['device_overrun_fraction']:.1%} of device steps overran the cost model"
            if r.get("device_overrun_fraction") is not None
            else ""
        ),
        f"{'cluster':<12} {'queries':>8} {'predicted tok':>14} {'actual tok':>11} {'KV token-s':>11}",
    ]
    for name, c in r["clusters"].items():
        lines.append(
            f"{name:<12} {c['queries']:>8} {c['predicted_tokens']:>14.0f} {c['actual_tokens']:>11} {c['kv_token_s']:>11.0f}"
        )
    if r.get("finish_spread") is not None:
        finishes = ", ".join(f"{c} {t:.1f} s" for c, t in r["finish_by_cluster"].items())
        lines.append(
            f"last result per cluster: {finishes}; finish spread {r['finish_spread']:.3f} of the makespan"
        )
    return "\n".join(lines)


def add_arguments(p) -> None:
    p.add_argument(
        "run",
        help="run directory (written by `fleetbatch loadgen study`, `wan`, `deadlines` or `prefix`)",
    )
    p.add_argument("--no-plots", action="store_true", help="figures only, no PNGs")


def run(args) -> dict:
    r = build_report(args.run, plots=not args.no_plots)
    print(format_report(r), flush=True)
    return r
