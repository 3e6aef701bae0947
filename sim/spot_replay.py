"""The simulator against ``fleetbatch loadgen spot``'s runs: ``sim_cost_error`` and ``sim_makespan_error``.

Each run directory (``results.jsonl``, ``meta.json``, ``clusters.yaml``, the deployment's plans under
``deploy/plans``, of :mod:`load.studies.spot`) is replayed by :class:`sim.spot.SpotSimulator` with nothing fitted:

* the same queries (prompt tokens, the lengths the engines generated, the gateway's predictions), one batch
  submitted at 0 with the run's completion window (``meta.json``'s ``window_s``; the on-demand run has none);
* the same fleet: each cluster on its plan's stages and devices (:class:`sim.pipelined.PipelinedEngine`, as the
  engines emulated them; the gateway's capacity is the plan's tokens/s), its price and market from the cluster
  file (:func:`gateway.assign.cost.fleet_prices`), the run's policy, offloading on (the gateway's default);
* the same events at the times they happened (from the batch's creation): a kill (its leases lapse after the
  engines' ``--lease-s``; checkpoints every ``--checkpoint-tokens``, as ``meta.json``'s ``engine_commands`` started
  them, else the engines' defaults), a notice as long as the engine took to stop, and each cluster back when
  its next engine process sent its first heartbeat (``meta.json``'s ``processes``).

``sim_cost_error`` (``sim_makespan_error``) is the mean over the runs of |simulated - real| / real cost
(makespan: the batch's creation to its completion).
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from clusterfile import load_cluster_file
from engines.worker_config import WorkerConfig
from gateway.assign.cost import SPOT_MARGIN, fleet_prices, spot_clusters
from load.studies.spot_floor import back_at
from planfile import load_plan
from sim.core import ClusterSpec, SimConfig
from sim.spot import Market, Outage, SpotSimulator
from sim.validate import _index
from sim.workload import Workload


def _option(argv: list[str], option: str) -> float | None:
    """The value of ``option`` in a command line (``--x V`` or ``--x=V``; None: not given)."""
    for i, a in enumerate(argv):
        if a == option and i + 1 < len(argv):
            return float(argv[i + 1])
        if a.startswith(option + "="):
            return float(a.split("=", 1)[1])
    return None


def _engine_option(meta: dict, option: str, default: float) -> float:
    """An engine option (``--lease-s``) as the run's engines were started with it (``meta.json``'s
    ``engine_commands``; the engines' default where it is not given)."""
    for argv in (meta.get("engine_commands") or {}).values():
        if (v := _option(argv, option)) is not None:
            return v
    return default


def _gateway_option(meta: dict, option: str, default: float) -> float:
    """A ``fleetbatch gateway up`` option the run gave (``meta.json``'s ``gateway_args``; else ``default``)."""
    v = _option(list(meta.get("gateway_args") or []), option)
    return default if v is None else v


def read_spot_run(path: str | Path) -> tuple[SpotSimulator, dict]:
    """The simulator set up as run ``path`` ran, and the run's real figures (``cost_dollars``, ``makespan_s``)."""
    run = Path(path)
    meta = json.loads((run / "meta.json").read_text())
    if not meta.get("completed_at"):
        raise ValueError(f"{run}: the batch never completed; nothing to compare")
    rows = [json.loads(line) for line in (run / "results.jsonl").read_text().splitlines() if line.strip()]
    rows.sort(key=lambda r: (_index(r["query_id"]), r["query_id"]))  # the workload's order
    work = Workload(
        prompt_tokens=[max(1, int(r.get("prompt_tokens") or 1)) for r in rows],
        true_tokens=[max(1, int(r.get("completion_tokens") or 1)) for r in rows],
        predicted_tokens=[float(r.get("predicted_tokens") or 0.0) for r in rows],
        arrival_s=[0.0] * len(rows),
        source=str(run),
    )
    fleet = load_cluster_file(run / "clusters.yaml").clusters
    specs = []
    for c in fleet:
        plan = run / "deploy" / "plans" / f"{c.name}.ilp.json"
        if not plan.exists():
            raise FileNotFoundError(f"{run}: no plan of cluster {c.name!r} at {plan}")
        tps = float(load_plan(plan).predicted_throughput_tokens_per_s)
        specs.append(ClusterSpec(c.name, backend="pipelined", capacity_tps=tps, plan=str(plan)))
    t0, events = meta["created_at"], meta["events"]
    outages = [
        Outage(
            e["cluster"],
            max(0.0, e["t"] - t0),
            e["kind"],
            notice_s=0.0 if e["kind"] == "kill" else max(0.0, e["stopped_t"] - e["t"]),
            back_t=(back_at(meta, e) or math.inf) - t0,
        )
        for e in events
    ]
    market = Market(
        prices=fleet_prices(fleet),
        spot=spot_clusters(fleet),
        window_s=meta.get("window_s"),
        checkpoint_tokens=int(_engine_option(meta, "--checkpoint-tokens", WorkerConfig.checkpoint_tokens)),
        lease_s=_engine_option(meta, "--lease-s", WorkerConfig.lease_s),
        spot_margin=_gateway_option(meta, "--spot-margin", SPOT_MARGIN),
    )
    cfg = SimConfig(policy=meta["policy"], offload=True, max_tokens=max(work.true_tokens, default=1))
    real = {"cost_dollars": meta["cost_dollars"], "makespan_s": meta["completed_at"] - t0}
    return SpotSimulator(specs, work, cfg, market, outages), real


def _error(sim: float, real: float) -> float | None:
    return abs(sim - real) / real if real > 0 else None


def replay(paths: list[str | Path]) -> dict:
    """Each run replayed; the mean relative errors of cost and makespan over them."""
    if not paths:
        raise ValueError("give at least one fleetbatch loadgen spot run directory")
    rows = []
    for p in paths:
        sim, real = read_spot_run(p)
        result = sim.run()
        cost = result.cost_dollars or 0.0
        rows.append(
            {
                "run": str(p),
                "real_cost_dollars": round(real["cost_dollars"], 5),
                "sim_cost_dollars": round(cost, 5),
                "cost_error": _round(_error(cost, real["cost_dollars"])),
                "real_makespan_s": round(real["makespan_s"], 2),
                "sim_makespan_s": round(result.makespan_s, 2),
                "makespan_error": _round(_error(result.makespan_s, real["makespan_s"])),
                "sim_clusters": {
                    n: {"queries": c["queries"], "cost_dollars": c.get("cost_dollars", 0.0)}
                    for n, c in result.per_cluster.items()
                },
                **(result.spot or {}),
            }
        )
    return {
        "sim_cost_error": _mean(r["cost_error"] for r in rows),
        "sim_makespan_error": _mean(r["makespan_error"] for r in rows),
        "runs": rows,
    }


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def _mean(xs) -> float | None:
    known = [x for x in xs if x is not None]
    return round(statistics.fmean(known), 4) if known else None
