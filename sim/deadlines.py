"""``python -m sim.cli deadlines``: the simulator's side of ``fleetbatch loadgen deadlines`` (which runs it apart:
``load`` does not import ``sim``).

* ``--workload FILE`` (prompt and true tokens, written by the harness): the makespan of the whole
  workload on the fleet, all at once: the ``T`` the scenario's windows are multiples of.
* run directories of ``fleetbatch loadgen deadlines`` (``results.jsonl``, ``meta.json``): each run replayed with
  its rows' lengths and predictions, its batches' submission times, order keys and deadlines (a row
  that expired unrun gets its predicted length; a queued row past its deadline expires): each
  batch's finish, seconds after the first submission, or null when some of it expired.

The fleet is the study's: ``--speeds`` (1,2,4) on the ``--device-cost`` device, token policy,
offloading, the capacity hints of ``fleetbatch loadgen study`` (100 / speed).
"""

from __future__ import annotations

import json
from pathlib import Path

from engines.device import StepCost
from sim.core import ClusterSpec, SimConfig, Simulator
from sim.costs import LinearCost
from sim.workload import Workload


def simulate(work: Workload, speeds, device_cost: str, batch: int) -> tuple[list[float], set[int]]:
    """Each query's finish (s) and the queries that expired queued."""
    d = StepCost.parse(device_cost)
    cost = LinearCost(d.prefill_per_token_s, d.decode_per_seq_s, d.step_overhead_s)
    specs = [
        ClusterSpec(
            f"c{i + 1}", cost.with_speed(1.0 / s), "iteration", batch, capacity_tps=round(100.0 / s, 3)
        )
        for i, s in enumerate(speeds)
    ]
    sim = Simulator(specs, work, SimConfig(policy="token", offload=True, max_tokens=max(work.true_tokens)))
    return sim.run().finish_s, sim.expired


def makespan(path: Path, speeds, device_cost: str, batch: int) -> float:
    w = json.loads(Path(path).read_text())
    n = len(w["prompt_tokens"])
    work = Workload(
        w["prompt_tokens"], w["true_tokens"], [float(t) for t in w["true_tokens"]], [0.0] * n, str(path)
    )
    return max(simulate(work, speeds, device_cost, batch)[0])


def replay(run_dir: Path, batch: int) -> dict[str, float | None]:
    rows = [json.loads(x) for x in (run_dir / "results.jsonl").read_text().splitlines() if x.strip()]
    meta = json.loads((run_dir / "meta.json").read_text())
    by_id = {v: k for k, v in meta["batch_ids"].items()}
    batches = meta["batches"]
    first = min(b["submitted_at"] for b in batches.values())
    names = [by_id[r["batch_id"]] for r in rows]
    work = Workload(
        prompt_tokens=[int(r.get("prompt_tokens") or 1) for r in rows],
        true_tokens=[
            max(1, int(r.get("completion_tokens") or 0) or round(float(r.get("predicted_tokens") or 1)))
            for r in rows
        ],
        predicted_tokens=[float(r.get("predicted_tokens") or 0.0) for r in rows],
        arrival_s=[batches[n]["submitted_at"] - first for n in names],
        source=str(run_dir),
        order_key=[batches[n]["order_key"] for n in names],
        deadline_s=[batches[n]["deadline"] - first for n in names],
    )
    finish, expired = simulate(work, meta["fleet"], meta["device_cost_ms"], batch)
    out: dict[str, float | None] = {n: 0.0 for n in batches}
    for i, (n, f) in enumerate(zip(names, finish, strict=True)):
        done = out[n]
        out[n] = None if i in expired or done is None else round(max(done, f), 3)
    return out


def add_arguments(p) -> None:
    p.add_argument("runs", nargs="*", help="run directories of `fleetbatch loadgen deadlines` to replay")
    p.add_argument("--workload", default=None, help="a workload file: print the fleet's makespan of it")
    p.add_argument(
        "--device-cost", default="15,0.2,1", help="the speed-1 device, ms: overhead,prefill,decode"
    )
    p.add_argument("--speeds", default="1,2,4", help="the fleet's step times relative to the fastest")
    p.add_argument("--max-running", type=int, default=8, help="engine batch size (max_running)")


def run(args) -> dict:
    speeds = [float(x) for x in args.speeds.split(",")]
    out: dict = {"replays": {str(r): replay(Path(r), args.max_running) for r in args.runs}}
    if args.workload:
        out["makespan_s"] = round(
            makespan(Path(args.workload), speeds, args.device_cost, args.max_running), 3
        )
    return out
