"""The spot benchmark's figures from its runs: cost ratios, deadlines, rows lost or duplicated, recomputed tokens.

**Recomputed tokens** (tokens an engine generated for a query less what the query's final answer kept) are
counted per engine process. A process generated ``G`` tokens: the cumulative ``generated_tokens`` of its
engine's last heartbeat (:class:`load.studies.spot_events.HeartbeatLog`; a counter that drops is the next
process of the cluster). It *kept* what survives of its runs in the final answers: for each result it wrote,
``completion_tokens`` less the partial output the run resumed from; for each query it gave back under a
notice or held when it was killed, its partial output then less the one it resumed from (the events'
readings). ``G - kept`` is what it generated for nothing; summed over the processes a notice stopped, over
the queries they gave back (``preempted_running_queries``), it is the figure *with notice*, and over the
killed ones, over the queries running at the kill, *after the hard kill*. A killed engine's last heartbeat
is up to one heartbeat interval (``renew_every_s``) old, so that figure misses what it generated since. The
processes still alive at the end recompute nothing by construction: their ``G - kept`` is reported as
``accounting_error_tokens``, the check of the method.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from pathlib import Path

from load.studies.spot_floor import cost_floor, measured_rates


def _handoffs(events: list[dict], batch_id: str) -> dict[str, list[tuple[float, int]]]:
    """Per query id: (time, tokens of its partial output) each time an event took it off a cluster."""
    out: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for e in events:
        for gid, n in e["partial"].items():
            out[gid.removeprefix(f"{batch_id}:")].append((e["stopped_t"], n))
    for v in out.values():
        v.sort()
    return out


def _resumed_from(handoffs: dict, qid: str, t: float) -> int:
    """The partial output a run of ``qid`` going on at ``t`` resumed from (the last handed off before ``t``)."""
    h = handoffs.get(qid, [])
    i = bisect.bisect_left(h, (t, -1))
    return h[i - 1][1] if i else 0


def recompute(run: dict) -> dict:
    """Per ending (``notice``, ``kill``, ``alive``): processes, queries, generated and recomputed tokens."""
    meta, rows = run["meta"], run["rows"]
    bid = meta["batch_id"]
    hand = _handoffs(meta["events"], bid)
    procs = sorted(meta["processes"], key=lambda p: (p["cluster"], p["start"]))
    by_cluster: dict[str, list[dict]] = defaultdict(list)
    for p in procs:
        by_cluster[p["cluster"]].append(p)
    for ps in by_cluster.values():  # a process runs from its first heartbeat to the next one's
        for a, b in zip(ps, [*ps[1:], None], strict=True):
            a["until"] = b["start"] if b is not None else float("inf")
            a["kept"], a["ending"], a["queries"] = 0, "alive", 0

    def owner(cluster: str, t: float) -> dict | None:
        ps = by_cluster.get(cluster, [])
        for p in ps:
            if t < p["until"]:
                return p
        return ps[-1] if ps else None

    finished_on = {}
    for r in rows:
        t = float((r.get("timings") or {}).get("finished_at") or 0.0)
        p = owner(r.get("cluster", ""), t)
        finished_on[r["query_id"]] = (r.get("cluster"), t)
        if p is not None:
            p["kept"] += int(r.get("completion_tokens") or 0) - _resumed_from(hand, r["query_id"], t)
    for e in meta["events"]:
        p = owner(e["cluster"], e["t"])
        if p is None:
            continue
        p["ending"] = e["kind"]
        for gid, n in e["partial"].items():
            qid = gid.removeprefix(f"{bid}:")
            cluster, t = finished_on.get(qid, (None, 0.0))
            if cluster == e["cluster"] and t <= e["stopped_t"] + 1.0:
                continue  # it finished there within the notice: counted with the results
            resumed = _resumed_from(hand, qid, e["t"])
            p["kept"] += n - resumed
            # a notice's query that had not started (claimed ahead) generated nothing: not a preempted running one
            p["queries"] += 1 if e["kind"] == "kill" or n > resumed else 0
    out: dict[str, dict] = {}
    for p in procs:
        o = out.setdefault(p["ending"], {"processes": 0, "queries": 0, "generated": 0, "recomputed": 0})
        o["processes"] += 1
        o["queries"] += p["queries"]
        o["generated"] += p["generated"]
        o["recomputed"] += p["generated"] - p["kept"]
    return out


def run_figures(run: dict) -> dict:
    meta, rows = run["meta"], run["rows"]
    ids = [r["query_id"] for r in rows]
    makespan = meta["completed_at"] - meta["created_at"] if meta["completed_at"] else None
    per_cluster: dict[str, dict] = {}
    for r in rows:
        c = per_cluster.setdefault(r.get("cluster", ""), {"rows": 0, "finish_s": 0.0})
        c["rows"] += 1
        t = float((r.get("timings") or {}).get("finished_at") or 0.0) - meta["created_at"]
        c["finish_s"] = round(max(c["finish_s"], t), 2)
    last = run["costs"][-1]["clusters"] if run["costs"] else {}
    for name, dollars in last.items():
        per_cluster.setdefault(name, {"rows": 0, "finish_s": 0.0})["cost_dollars"] = round(dollars, 5)
    rec = recompute(run) if meta["events"] else {}
    return {
        "cost_dollars": round(meta["cost_dollars"], 5),
        "makespan_s": round(makespan, 2) if makespan is not None else None,
        "window_s": round(meta["window_s"], 1) if meta["window_s"] else None,
        "deadline_met": bool(
            meta["deadline"] and meta["completed_at"] and meta["completed_at"] <= meta["deadline"]
        ),
        "status": meta["status"],
        "lost": run["total"] - len(set(ids)),
        "duplicated": len(ids) - len(set(ids)),
        "resumed_after_kill": sum(1 for r in rows if int(r.get("attempts") or 1) > 1),
        "preempted_running_queries": rec.get("preempt", {}).get("queries", 0),
        "killed_running_queries": rec.get("kill", {}).get("queries", 0),
        "recompute": rec,
        "clusters": per_cluster,
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def summarise(
    runs: dict[str, dict],
    windows: list[str],
    replayed: dict | None = None,
    prices: dict[str, float] | None = None,
) -> dict:
    """The last line's object from the runs by setup name, the simulator's replay of them (``fleetbatch sim
    spot-replay``'s object; None or empty: not replayed, its figures null), and with the spot fleet's ``prices``,
    the cost floor of each window (:mod:`load.studies.spot_floor`)."""
    figs = {name: run_figures(r) for name, r in runs.items()}
    out: dict = {}
    base = figs["on_demand"]["cost_dollars"]
    rates = measured_rates(runs["on_demand"]) if prices else {}  # the floor needs both
    floors: dict[str, dict | None] = {}
    for w in windows:
        a, b = figs[f"cost_{w}"]["cost_dollars"], figs[f"token_{w}"]["cost_dollars"]
        sfx = "" if w == "loose" else f"_{w}"
        out[f"cost_vs_token_same_fleet{sfx}"] = _ratio(a, b)
        out[f"cost_vs_on_demand{sfx}"] = _ratio(a, base)
        floors[w] = floor = cost_floor(runs[f"cost_{w}"], rates, prices) if prices else None
        least = floor["cost_dollars"] if floor else None
        out[f"cost_floor_vs_token_same_fleet{sfx}"] = _ratio(least, b)
        out[f"cost_floor_vs_on_demand{sfx}"] = _ratio(least, base)
    spot = [f for n, f in figs.items() if n != "on_demand"]
    out["deadlines_met"] = {n: f["deadline_met"] for n, f in figs.items() if n != "on_demand"}
    out["preempted_running_queries"] = min((f["preempted_running_queries"] for f in spot), default=0)
    sums = {k: [0, 0] for k in ("preempt", "kill", "alive")}
    for f in spot:
        for k, v in f["recompute"].items():
            sums[k][0] += v["recomputed"]
            sums[k][1] += v["queries"]
    out["recomputed_tokens_per_preempted_query"] = {
        "with_notice": round(sums["preempt"][0] / sums["preempt"][1], 2) if sums["preempt"][1] else None,
        "after_hard_kill": round(sums["kill"][0] / sums["kill"][1], 2) if sums["kill"][1] else None,
        "accounting_error_tokens": sums["alive"][0],
    }
    out["lost"] = sum(f["lost"] for f in figs.values())
    out["duplicated"] = sum(f["duplicated"] for f in figs.values())
    replayed = replayed or {}
    out["sim_cost_error"] = replayed.get("sim_cost_error")
    out["sim_makespan_error"] = replayed.get("sim_makespan_error")
    if replayed.get("runs"):
        out["sim_runs"] = {Path(r["run"]).name: r for r in replayed["runs"]}
    out["cost_floor"] = floors
    out["runs"] = figs
    return out
