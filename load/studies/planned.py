"""``fleetbatch loadgen study --planned``: the planners' claim measured end to end, through the gateway.

One fleet of unlike clusters (a fleet file; by default fast = 2 x A100-40G, medium = V100-32G +
T4, slow = 2 x T4), run three times on the same workload, each a real ``fleetbatch gateway up --clusters``
(the token policy, offloading off, engines running their plans' stages on emulated devices):

* ``planned``: every cluster runs the ILP's plan;
* ``even``: an even layer split over the cluster's devices at the highest uniform bit width that
  fits each device (LLM-PQ's Uniform baseline);
* ``best_baseline``: per cluster the better of the planner's baselines (Uniform, Het), as the
  planner's model rates them.

Ratios of measured tokens/s, each next to the planner's modelled ratio (the sum of the plans'
predicted tokens/s, which is what the capacity-weighted fleet delivers when every cluster
runs at its plan's rate). ``capacity_error`` is the mean relative error of each cluster's
plan-predicted tokens/s against what it measured (its output tokens over the time to its
last finish) over the three runs; ``device_overrun_fraction`` the largest share, over the runs,
of micro-batches whose real compute outlasted their device; ``sim_makespan_error`` the
simulator's error replaying the three runs on the plans' cost models (``python -m sim.cli
validate``).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from tqdm import tqdm

from clusterfile import dump_cluster_file
from load.reports.layout import mean_lengths
from load.reports.report import build_report
from load.reports.runrecord import write_run
from load.studies.run import run_deployed
from load.workload import WorkItem

#: setup name -> ``fleetbatch gateway up --fleet-method``
SETUPS = {"planned": "ilp", "even": "uniform", "best_baseline": "best-baseline"}
RATIOS = {"planned_over_even": "even", "planned_over_best_baseline": "best_baseline"}


def run_setup(
    name: str, method: str, items: list[WorkItem], run_dir: Path, args, lengths: tuple[int, int]
) -> dict:
    """One planned fleet through ``fleetbatch gateway up``; the run's report with its clusters' plans."""
    run_dir.mkdir(parents=True, exist_ok=True)
    up_args = ["--clusters", args.clusters, "--fleet-method", method, "--fleet-lengths", f"{lengths[0]},{lengths[1]}",
               "--policy", "token", "--no-offload", *args.gateway_arg]  # fmt: skip
    info, (batch_id,), rows = run_deployed(run_dir, up_args, items, f"planned-{name}")
    layouts = info.get("layouts") or {}
    (run_dir / "plans").mkdir(exist_ok=True)
    planned = {}
    for cluster, row in layouts.items():
        dst = run_dir / "plans" / f"{cluster}.json"
        shutil.copyfile(row["plan"], dst)
        planned[cluster] = {**row, "plan": str(dst.relative_to(run_dir))}
    meta = {
        "batch_id": batch_id,
        "policy": "token",
        "backend": "native",
        "planned": {"method": method, "clusters": planned},
    }
    write_run(run_dir, rows, meta)
    clusters = [
        {"name": c, "capacity_tps": p["predicted_tokens_per_s"], "backend": "native", "plan": p["plan"]}
        for c, p in planned.items()
    ]
    dump_cluster_file(run_dir / "clusters.yaml", clusters)
    report = build_report(run_dir)
    report["predicted_tokens_per_s"] = round(sum(r["predicted_tokens_per_s"] for r in layouts.values()), 1)
    return report


def summarise(reports: dict[str, dict]) -> dict:
    """The study's figures from the three runs' reports."""
    out: dict = {}
    for ratio, base in RATIOS.items():
        if "planned" in reports and base in reports:
            p, b = reports["planned"], reports[base]
            out[ratio] = round(p["tokens_per_s"] / max(b["tokens_per_s"], 1e-9), 3)
            out[f"modelled_{ratio}"] = round(
                p["predicted_tokens_per_s"] / max(b["predicted_tokens_per_s"], 1e-9), 3
            )
    errors = [r["error"] for rep in reports.values() for r in rep["plans"].values() if r["error"] is not None]
    out["capacity_error"] = round(sum(errors) / len(errors), 3) if errors else None
    overruns = [rep.get("device_overrun_fraction") for rep in reports.values()]
    out["device_overrun_fraction"] = max((o for o in overruns if o is not None), default=None)
    return out


def run_planned(args, items: list[WorkItem], sim) -> dict:
    """All three setups (``--only`` picks some), the summary; ``sim`` runs the simulator's validation."""
    root = Path(args.out)
    chosen = [n for n in SETUPS if not args.only or n in args.only.split(",")]
    if not chosen:
        raise ValueError(f"--only names no setup; known with --planned: {', '.join(SETUPS)}")
    lengths = mean_lengths(items)
    reports = {}
    bar = tqdm(total=len(chosen), desc="planned study", unit="run", disable=args.no_progress)
    for name in chosen:
        bar.set_postfix_str(name)
        reports[name] = run_setup(name, SETUPS[name], items, root / name, args, lengths)
        bar.update(1)
    bar.close()
    out = summarise(reports)
    replayed = [str(root / n) for n in chosen]
    out["sim_makespan_error"] = sim("validate", *replayed).get("sim_makespan_error")
    out["runs"] = {
        n: {
            "tokens_per_s": r["tokens_per_s"],
            "makespan_s": r["makespan_s"],
            "predicted_tokens_per_s": r["predicted_tokens_per_s"],
            "device_overrun_fraction": r.get("device_overrun_fraction"),
            "clusters": r["plans"],
        }
        for n, r in reports.items()
    }
    out.update(queries=len(items), fleet=args.clusters, planned_lengths=list(lengths), out=str(root))
    return out
