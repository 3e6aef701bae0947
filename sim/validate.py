"""The simulator against real runs: ``sim_makespan_error`` on ``fleetbatch loadgen study`` run directories.

Each real run (``results.jsonl``, ``meta.json``, ``clusters.yaml`` of :mod:`load.studies.study`) is
replayed in cost-model time with the same queries (prompt tokens, the lengths the engines
generated, the gateway's predictions, in submission order), the same policy, backend, batch
size and capacity hints, and offloading as the run had it (``meta.json``). The step cost is one
:class:`sim.costs.LinearCost` for every run; its scale (the emulated device's speed, which the
cost model cannot know) is fitted by leave-one-out: the held-out run's makespan is predicted
with the median real/simulated ratio of the *other* runs of its session (one study repeat;
the machine's speed drifts between sessions). ``sim_makespan_error`` is the mean relative
error of those predictions.

Runs whose engines emulated their device by cost model (``fleetbatch loadgen study --emulation cost``, the
default; ``meta.json`` names the device as ``device_cost_ms``) need no fit: the simulator replays
them on that very device, and the error is that of the simulation itself (queue and gateway
overheads, step-boundary timing) with nothing calibrated on the runs.

Planned runs (``fleetbatch loadgen study --planned``: ``meta.json`` has ``planned``, each cluster's plan under
``plans/``) are replayed the same way with nothing fitted, each cluster as
:class:`sim.pipelined.PipelinedEngine` on its plan (its stages on their plan devices' cost models,
as the engines emulated them), the capacity the gateway used being the plan's tokens/s. One
planned run is enough; planned runs are not validated together with other runs.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from clusterfile import load_cluster_file
from engines.device import StepCost
from planfile import load_plan
from sim.core import ClusterSpec, SimConfig, SimResult, Simulator
from sim.costs import LinearCost
from sim.workload import Workload


@dataclass(frozen=True)
class RealRun:
    path: Path
    policy: str
    backend: str  # "iteration" | "static"
    batch: int
    speeds: list[float]
    hints: list[float]
    work: Workload
    makespan_s: float
    device_cost_ms: str | None = None  # the emulated speed-1 device of --emulation cost runs
    names: list[str] | None = None  # the clusters' names (planned runs; else c1, c2, ...)
    plans: list[str] | None = (
        None  # planned runs (``fleetbatch loadgen study --planned``): each cluster's plan file
    )
    offload: bool = False  # the run's gateway offloaded (``meta.json``: ``offload``)
    kv_budget_tokens: int = 16384  # each engine's KV cache (``--kv-budget-tokens``)
    prefix_cache: bool = True  # the engines' prefix cache (off: ``--no-prefix-cache``)


def _index(query_id: str) -> int:
    tail = query_id.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else 0


def read_run(path: str | Path) -> RealRun:
    run = Path(path)
    rows = [json.loads(line) for line in (run / "results.jsonl").read_text().splitlines() if line.strip()]
    rows.sort(key=lambda r: (_index(r["query_id"]), r["query_id"]))  # submission order
    meta = json.loads((run / "meta.json").read_text())
    fleet = [c.model_dump() for c in load_cluster_file(run / "clusters.yaml").clusters]
    args = fleet[0].get("engine_args") or []
    batch = int(args[args.index("--max-running") + 1]) if "--max-running" in args else 8
    t0 = min(float(r["timings"]["enqueued_at"]) for r in rows)
    end = max(float(r["timings"]["finished_at"]) for r in rows)
    prompts = [int(r.get("prompt_tokens") or 1) for r in rows]
    # fleetbatch loadgen prefix: each row's prefix group and shared tokens, as the gateway's rule finds them
    shared = json.loads((run / "prefixes.json").read_text()) if (run / "prefixes.json").exists() else None
    pairs = [shared.get(r["query_id"], [None, 0]) for r in rows] if shared is not None else None
    work = Workload(
        prompt_tokens=prompts,
        true_tokens=[max(1, int(r.get("completion_tokens") or 1)) for r in rows],
        predicted_tokens=[float(r.get("predicted_tokens") or 0.0) for r in rows],
        arrival_s=[0.0] * len(rows),
        source=str(run),
        prefix_group=[g for g, _ in pairs] if pairs else None,
        prefix_tokens=[
            min(int(t), p) if g is not None else 0 for (g, t), p in zip(pairs, prompts, strict=True)
        ]
        if pairs
        else None,
    )
    kv = int(args[args.index("--kv-budget-tokens") + 1]) if "--kv-budget-tokens" in args else 16384
    planned = meta.get("planned")
    if planned is not None:  # fleetbatch loadgen study --planned: every cluster runs its plan's stages
        plans = [str(run / planned["clusters"][c["name"]]["plan"]) for c in fleet]
        return RealRun(
            path=run,
            policy=meta["policy"],
            backend="pipelined",
            batch=batch,
            speeds=[1.0] * len(fleet),
            # the gateway's capacity: the plan's tokens/s (plan_tps), not the rounded hint of clusters.yaml
            hints=[load_plan(p).predicted_throughput_tokens_per_s for p in plans],
            work=work,
            makespan_s=end - t0,
            names=[str(c["name"]) for c in fleet],
            plans=plans,
        )
    return RealRun(
        path=run,
        policy=meta["policy"],
        backend="static" if meta["backend"] == "static" else "iteration",
        batch=batch,
        speeds=[float(s) for s in meta["fleet"]],
        hints=[float(c["capacity_tps"]) for c in fleet],
        work=work,
        makespan_s=end - t0,
        device_cost_ms=meta.get("device_cost_ms"),
        offload=bool(meta.get("offload", False)),
        kv_budget_tokens=kv,
        prefix_cache="--no-prefix-cache" not in args,
    )


def simulate(run: RealRun, cost: LinearCost) -> float:
    return replay(run, cost).makespan_s


def replay(run: RealRun, cost: LinearCost) -> SimResult:
    """The run in the simulator (its makespan, prefill and prefix-cache hits)."""
    if run.plans is not None:  # each cluster on its plan's devices: nothing of ``cost`` is used
        specs = [
            ClusterSpec(name, backend="pipelined", capacity_tps=hint, plan=plan)
            for name, hint, plan in zip(run.names or [], run.hints, run.plans, strict=True)
        ]
        cfg = SimConfig(policy=run.policy, offload=False, max_tokens=max(run.work.true_tokens))
        return Simulator(specs, run.work, cfg).run()
    specs = [
        ClusterSpec(
            f"c{i + 1}", cost.with_speed(1.0 / speed), run.backend, run.batch, run.kv_budget_tokens, hint
        )
        for i, (speed, hint) in enumerate(zip(run.speeds, run.hints, strict=True))
    ]  # a speed of 2 in the study is a 2x slower device
    cfg = SimConfig(
        policy=run.policy,
        offload=run.offload,
        max_tokens=max(run.work.true_tokens),
        prefix_cache=run.prefix_cache,
    )
    return Simulator(specs, run.work, cfg).run()


def validate(paths: list[str | Path], cost: LinearCost) -> dict:
    """Leave-one-out makespan error of the simulator on real runs.

    The held-out run's scale is the median real/simulated ratio of the other runs *of the same
    session* (the runs in the same directory: one ``fleetbatch loadgen study`` repeat, measured minutes
    apart on the same machine), or of all other runs when it is alone in its session. A shared
    CPU's speed drifts between sessions (a third between two repeats on an idle machine), which
    no cost model can know; ``sim_makespan_error_pooled`` fits one scale over every session,
    as before, for comparison."""
    runs = [read_run(p) for p in paths]
    planned = [r.plans is not None for r in runs]
    if any(planned) and not all(planned):
        raise ValueError(
            "planned runs (fleetbatch loadgen study --planned) are validated apart from the other studies' runs"
        )
    devices = {r.device_cost_ms for r in runs}
    # planned runs: every stage emulated its plan device's cost model, replayed on the plans (no fit)
    known = all(planned) or (len(devices) == 1 and None not in devices)
    if not known and len(runs) < 2:
        raise ValueError("validation needs at least two real runs (one scale is fitted on the others)")
    if known and not all(planned):  # the engines emulated this very cost model: replay on it, fit nothing
        device = StepCost.parse(devices.pop())
        cost = LinearCost(device.prefill_per_token_s, device.decode_per_seq_s, device.step_overhead_s)
    results = [replay(r, cost) for r in runs]
    simulated = [s.makespan_s for s in results]
    real = [r.makespan_s for r in runs]
    if known:
        predicted = pooled = simulated
    else:
        predicted = held_out(real, simulated, [str(r.path.parent) for r in runs])
        pooled = held_out(real, simulated, [""] * len(runs))
    errors = [abs(p - m) / m for p, m in zip(predicted, real, strict=True)]
    rows = [
        {
            "run": str(r.path),
            "real_makespan_s": round(m, 2),
            "sim_makespan_s": round(p, 2),
            "error": round(e, 3),
            "sim_hit_rate": round(s.hit_rate, 4),
            "sim_prefill_tokens": s.prefill_tokens,
        }
        for r, m, p, e, s in zip(runs, real, predicted, errors, results, strict=True)
    ]
    return {
        "sim_makespan_error": round(statistics.fmean(errors), 3),
        "sim_makespan_error_pooled": round(
            statistics.fmean(abs(p - m) / m for p, m in zip(pooled, real, strict=True)), 3
        ),
        "max_error": round(max(errors), 3),
        "scale": round(statistics.median(m / s for m, s in zip(real, simulated, strict=True)), 3),
        "fitted": not known,  # False: replayed on the runs' own emulated device, no scale fitted
        "runs": rows,
    }


def held_out(real: list[float], simulated: list[float], sessions: list[str]) -> list[float]:
    """Each run's makespan predicted from its simulated one and the median real/simulated ratio of the
    other runs of its session (of all other runs when it is alone in its session)."""
    ratios = [m / s for m, s in zip(real, simulated, strict=True)]
    out = []
    for i, session in enumerate(sessions):
        others = [j for j in range(len(real)) if j != i]
        same = [j for j in others if sessions[j] == session] or others
        out.append(simulated[i] * statistics.median(ratios[j] for j in same))
    return out
