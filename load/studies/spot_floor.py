"""The least a spot run could have cost: the cost policy's LP with what the run taught (``cost_floor``).

For each spot run of ``fleetbatch loadgen spot``, the split of the batch's work that :func:`gateway.assign.cost.
cost_targets` finds cheapest had it known, at submission, what the run measured:

* each cluster's real rate, from the on-demand run: the work it answered there (generated tokens plus a prompt
  token at :data:`gateway.assign.loads.PROMPT_WEIGHT`, :func:`gateway.assign.loads.work`) over the time to its
  last answer (the plans' rates, which the policy uses, are not what the emulated engines turn out);
* each spot cluster's time down in that run: from each kill, or each notice's engine stop, to the first heartbeat
  of its next engine process (``meta.json``'s ``events`` and ``processes``), as work it cannot do in the window;
* every cluster done within the policy's margin (:data:`gateway.assign.cost.MARGIN`) of the window, and no room
  kept for a preemption (the downtime is known), nothing lost, nothing recomputed, nothing moved.

The floor is that split's cost under the billing model (a cluster billed for its share's time at its rate,
never while down). Its ratios to the token run's and the on-demand run's costs are what the policy could save
at best on this fleet and these preemptions with its margin: a goal below them cannot be met by any split that
keeps every cluster within the margin (with none, every cluster busy to the window's last second, the floor is
lower: ``margin`` 1).
"""

from __future__ import annotations

import math
from collections import defaultdict

from gateway.assign.cost import MARGIN, cost_targets, dollars_per_second
from gateway.assign.loads import ClusterView, work


def measured_rates(on_demand: dict) -> dict[str, float]:
    """Each cluster's work units a second in the on-demand run: what it answered over the time to its last answer."""
    t0 = on_demand["meta"]["created_at"]
    done: dict[str, float] = defaultdict(float)
    last: dict[str, float] = defaultdict(float)
    for r in on_demand["rows"]:
        c = r.get("cluster", "")
        done[c] += work(int(r.get("prompt_tokens") or 0), int(r.get("completion_tokens") or 0))
        t = float((r.get("timings") or {}).get("finished_at") or t0) - t0
        last[c] = max(last[c], t)
    return {c: done[c] / last[c] for c in done if last[c] > 0 and done[c] > 0}


def back_at(meta: dict, event: dict) -> float:
    """When the cluster of a kill or a notice (one of ``meta.json``'s ``events``) took work again: the first heartbeat
    of its next engine process after the engine stopped (``processes``), else the admin's ``back_t`` (0: never)."""
    starts = [
        p["start"]
        for p in meta["processes"]
        if p["cluster"] == event["cluster"] and p["start"] > event["stopped_t"]
    ]
    return min(starts) if starts else float(event.get("back_t") or 0.0)


def downtime(run: dict) -> dict[str, float]:
    """Seconds each cluster could not work in a run: from each kill, or each notice's engine stop (it runs on through
    the notice), to when it took work again (:func:`back_at`)."""
    meta = run["meta"]
    out: dict[str, float] = defaultdict(float)
    for e in meta["events"]:
        back = back_at(meta, e)
        if back > e["stopped_t"]:
            out[e["cluster"]] += back - e["stopped_t"]
    return dict(out)


def cost_floor(
    run: dict, rates: dict[str, float], prices: dict[str, float], margin: float = MARGIN
) -> dict | None:
    """The floor of one spot run (module docstring): its cost (dollars), each cluster's share of the work and the
    time it is billed, and whether the window allowed a split at all (``at_risk``: none did; the fastest finish's
    cost instead). None for a run without a window or without rates."""
    window = run["meta"].get("window_s")
    if not window or not rates:
        return None
    total = math.fsum(
        work(int(r.get("prompt_tokens") or 0), int(r.get("completion_tokens") or 0)) for r in run["rows"]
    )
    down = downtime(run)
    names = sorted(rates)
    # a cluster's downtime as work it holds (it cannot run the batch then): the LP's finish constraint
    views = [ClusterView(n, rates[n], pending_tokens=rates[n] * down.get(n, 0.0)) for n in names]
    plan = cost_targets(views, prices, total, window, margin=margin)
    billed = {n: x / rates[n] for n, x in zip(names, plan.targets, strict=True)}  # never while down
    dollars = math.fsum(dollars_per_second(prices, n) * s for n, s in billed.items())
    return {
        "cost_dollars": round(dollars, 5),
        "at_risk": plan.at_risk,
        "share": {n: round(x / total, 3) for n, x in zip(names, plan.targets, strict=True)},
        "billed_s": {n: round(s, 1) for n, s in billed.items()},
        "down_s": {n: round(s, 1) for n, s in down.items()},
    }
