"""The figures of ``fleetbatch loadgen prefix`` (:mod:`load.studies.prefix`): makespans, prefix-cache hit rates, the simulator's replay."""

from __future__ import annotations

import statistics
from pathlib import Path

#: setup name -> (assignment policy, engines' prefix cache on)
SETUPS: dict[str, tuple[str, bool]] = {
    "token": ("token", True),
    "prefix": ("prefix", True),
    "token_nocache": ("token", False),
}


def makespan(rows: list[dict]) -> float:
    """First enqueue to last finish, as the simulator's validation measures a real run."""
    t0 = min(float(r["timings"]["enqueued_at"]) for r in rows)
    return max(float(r["timings"]["finished_at"]) for r in rows) - t0


def hit_rate(beats: dict[str, dict]) -> float | None:
    """Prompt tokens found in the engines' prefix caches over those looked up (their heartbeats' totals)."""
    hit = sum(float(b.get("prefix_hit_tokens") or 0) for b in beats.values())
    looked = sum(float(b.get("prefix_lookup_tokens") or 0) for b in beats.values())
    return round(hit / looked, 4) if looked else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def summarise(runs: dict[str, dict], replay: dict, items: list, prefixes: dict[str, list]) -> dict:
    """The JSON object: ``prefix_aware_over_token``, ``hit_rate``, ``sim_makespan_error`` and per-setup figures."""
    sim = {Path(r["run"]).name: r for r in replay.get("runs") or []}
    per: dict[str, dict] = {}
    for name, r in runs.items():
        rows = r["rows"]
        ok = sum(1 for x in rows if not x.get("error"))
        s = sim.get(name, {})
        per[name] = {
            "makespan_s": round(makespan(rows), 2),
            "hit_rate": hit_rate(r["heartbeats"]),
            "completed": ok,
            "rows": len(rows),
            "sim_makespan_s": s.get("sim_makespan_s"),
            "sim_error": s.get("error"),
            "sim_hit_rate": s.get("sim_hit_rate"),
        }
    mk = {n: p["makespan_s"] for n, p in per.items()}
    smk = {n: p["sim_makespan_s"] for n, p in per.items()}
    grouped = [v for v in prefixes.values() if v[0] is not None]
    out = {
        "prefix_aware_over_token": _ratio(mk.get("token"), mk.get("prefix")),
        "hit_rate": per.get("prefix", {}).get("hit_rate"),
        "sim_makespan_error": replay.get("sim_makespan_error"),
        "sim_prefix_aware_over_token": _ratio(smk.get("token"), smk.get("prefix")),
        "cache_on_over_off": _ratio(mk.get("token_nocache"), mk.get("token")),
        "hit_rate_token": per.get("token", {}).get("hit_rate"),
        "runs": per,
        "grouped_rows": len(grouped),
        "prefix_groups": len({v[0] for v in grouped}),
        "mean_shared_prefix_tokens": round(statistics.fmean(v[1] for v in grouped), 1) if grouped else 0.0,
        "mean_answer_tokens": round(statistics.fmean(it.forced_length for it in items), 1) if items else 0.0,
    }
    for name in runs:
        out[f"makespan_{name}_s"] = per[name]["makespan_s"]
        out[f"hit_rate_{name}"] = per[name]["hit_rate"]
    return out
