"""Plan every cluster of a fleet (``fleetbatch planner fleet``): plan files with their devices' cost models, cached.

For each cluster of the fleet file (:mod:`planner.fleet`) and each method asked for (``ilp``: the
planner; ``uniform``: an even layer split at the highest uniform bit width that fits; ``het``:
a speed-balanced split at one bit width; see :mod:`planner.baselines`), this writes
``<out>/<cluster>.<method>.json``, a plan whose devices carry their emulated cost model
(``planfile.device_cost``) and whose ``memory_bytes`` (the engine's cap) adds what the budget leaves
out (the KV pool of the engine's ``kv_tokens`` for the stage's layers, embeddings, head,
activations), counted at the engine's float32, and ``<out>/fleet-plans.json``, the summary
``fleetbatch gateway up --fleet`` and ``fleetbatch loadgen study --planned`` read: per cluster and method the plan's
path, devices, layer split, bits, micro-batch sizes, predicted tokens/s and solve time.

Plans are cached by the content of (fleet, model, CPU profile, workload, methods): a second run
with the same inputs reads the summary back instead of solving again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from planfile import DeviceCost, Plan, save_plan
from planner.baselines import het, uniform
from planner.build import make_plan
from planner.cluster import Cluster
from planner.costs import Assignment, Problem, Workload
from planner.fleet import DEFAULT_BITS, Fleet, fleet_clusters, fleet_profiles
from planner.latency import Profile
from planner.modelshape import ModelShape
from planner.problem import build_problem
from planner.search import plan as search_plan
from quant import accounting

log = logging.getLogger(__name__)

METHODS = ("ilp", "uniform", "het")
#: the engines on this CPU hold float32 where the planner counts 16-bit bytes (KV pool, embeddings,
#: head, 16-bit layers): an emulated device's cap on the engine's real bytes is this many times its
#: budget (quantized layers take the planner's bytes exactly, so the cap is an upper bound for them)
HOST_BYTES_PER_16_BIT = 2
SUMMARY = "fleet-plans.json"


@dataclass(frozen=True)
class FleetJob:
    """What to plan: the fleet, the served model, this CPU's profile of it, the workload, the methods."""

    fleet: Fleet
    shape: ModelShape
    profile: Profile
    workload: Workload
    methods: tuple[str, ...] = ("ilp",)
    kv_tokens: int = 16384
    time_limit_s: float = 6.0
    # what every layer at the lowest bits costs in the objective, as a share of the cluster's Uniform
    # baseline's batch latency (LLM-PQ's theta, made independent of the emulation's time scale)
    quality_weight: float = 0.3

    def digest(self) -> str:
        w = self.workload
        key = {
            "fleet": self.fleet.to_dict(),
            "model": self.shape.essentials(),
            "profile": self.profile.to_dict(),
            "workload": [w.batch, w.prompt_len, w.output_tokens, w.kv_bits, list(w.bits), w.theta],
            "methods": list(self.methods),
            "kv_tokens": self.kv_tokens,
            "time_limit_s": self.time_limit_s,
            "quality_weight": self.quality_weight,
        }
        return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


def device_cost(problem: Problem, type_name: str) -> DeviceCost:
    """The cost model the planner used for device type ``type_name``, as the plan carries it."""
    lm = problem.latency[type_name]
    return DeviceCost(dict(lm.prefill_coef), dict(lm.decode_coef), lm.head_coef)


def solve(problem: Problem, method: str, time_limit_s: float):
    """``(assignment, evaluation, seconds)`` of ``method`` on ``problem``, None when nothing fits."""
    t0 = time.perf_counter()
    if method in ("uniform", "het"):
        r = (uniform if method == "uniform" else het)(problem)
        return None if r is None else (r[0], r[1], time.perf_counter() - t0)
    base = het(problem)
    sr = search_plan(
        problem,
        "ilp",
        time_limit_s=time_limit_s,
        starts=[base[0]] if base else None,
        kappas=[1],  # the native engine prefills each prompt whole
        tp_sizes=(1,),  # one device per stage process
    )
    return None if sr is None else (sr.assignment, sr.evaluation, sr.solve_seconds)


def plan_cluster(problem: Problem, method: str, kv_tokens: int, time_limit_s: float) -> Plan | None:
    """The plan of ``method`` for ``problem``'s cluster, with device costs and the engine's memory caps."""
    res = solve(problem, method, time_limit_s)
    if res is None:
        return None
    pl = make_plan(problem, res[0], res[1], method, res[2])
    for k, st in enumerate(pl.stages):
        dev = pl.devices[st.device_index]
        dev["cost"] = device_cost(problem, dev["type"]).to_dict()
        budget = dev["memory_bytes"] + granted_bytes(problem, res[0], k, kv_tokens)
        dev["memory_bytes"] = int(HOST_BYTES_PER_16_BIT * budget)
    pl.extra["emulated"] = {
        "kv_tokens": kv_tokens,
        "budget": "layer weights; KV, embeddings, head granted apart",
    }
    return pl


def granted_bytes(problem: Problem, a: Assignment, k: int, kv_tokens: int) -> int:
    """What stage ``k`` holds besides its layer weights, granted on top of its device's budget: the
    engine's KV pool (``kv_tokens`` per layer), embeddings (first stage), LM head (last), activations."""
    m, shape = problem.memory, problem.shape
    n, (lo, hi) = len(a.order), a.layer_ranges()[k]
    kv = kv_tokens * accounting.kv_bytes_per_token(shape.config, problem.workload.kv_bits) * (hi - lo)
    first, last = k == 0, k == n - 1
    return (
        kv
        + m.activation_bytes(a.v_prefill, a.v_decode, last, a.kappa)
        + (m.embedding_bytes() if first else 0)
        + (m.head_bytes(also_first=first) if last else 0)
    )


def summary_row(pl: Plan, path: Path) -> dict:
    """What ``fleetbatch gateway up`` prints and ``loadgen`` reads of one plan."""
    return {
        "plan": str(path),
        "method": pl.method,
        "devices": [pl.devices[st.device_index]["type"] for st in pl.stages],
        "layers": [[st.layer_start, st.layer_end] for st in pl.stages],
        "bits": [list(st.bits) for st in pl.stages],
        "prefill_micro_batch": pl.prefill_micro_batch,
        "decode_micro_batch": pl.decode_micro_batch,
        "predicted_tokens_per_s": round(pl.predicted_throughput_tokens_per_s, 2),
        "solve_seconds": round(pl.solve_seconds, 3),
    }


def cluster_problem(cluster: Cluster, job: FleetJob, profiles: dict[str, Profile]) -> Problem:
    """``cluster``'s planning problem, its quality weight ``theta`` in seconds set to ``job.quality_weight``
    times the batch latency of its Uniform baseline (else Het): quality then counts as much whatever the
    emulated devices' time scale (the objective adds seconds to ``theta`` x the normalised omega)."""
    problem = build_problem(cluster, job.shape, job.workload, profiles=profiles, weights_only=True)
    base = uniform(problem) or het(problem)
    if base is None:
        return problem
    theta = job.quality_weight * base[1].latency_s
    # the same latency models and quality indicator, fitted once; only the workload's theta changes
    w = replace(job.workload, theta=theta)
    return Problem(cluster, job.shape, w, problem.omega, problem.latency, weights_only=True)


def plan_fleet(job: FleetJob, out: Path) -> dict:
    """Plan every cluster by every method of ``job`` into ``out``; the summary (read back when cached)."""
    out.mkdir(parents=True, exist_ok=True)
    digest = job.digest()
    summary_file = out / SUMMARY
    if summary_file.is_file():
        try:
            cached = json.loads(summary_file.read_text())
        except json.JSONDecodeError:
            cached = {}
        if cached.get("digest") == digest and all(
            Path(r["plan"]).is_file() for c in cached.get("clusters", {}).values() for r in c.values()
        ):
            log.info("fleet plans cached in %s (digest %s): not solving again", out, digest)
            return {**cached, "cached": True}
    profiles = fleet_profiles(job.fleet, job.profile, job.shape, job.workload.bits)
    clusters: dict[str, dict] = {}
    for name, cluster in fleet_clusters(job.fleet, job.shape).items():
        problem = cluster_problem(cluster, job, profiles)
        clusters[name] = {}
        for method in job.methods:
            pl = plan_cluster(problem, method, job.kv_tokens, job.time_limit_s)
            if pl is None:
                raise ValueError(
                    f"cluster {name} ({', '.join(job.fleet.clusters[name])}): no {method} plan fits "
                    f"{job.shape.name}; give it more or larger devices"
                )
            path = out / f"{name}.{method}.json"
            save_plan(pl, path)
            row = summary_row(pl, path)
            log.info(
                "planned %s by %s in %.2f s: %d stage(s) on %s, layers %s, bits %s, %.0f tokens/s predicted",
                name, method, pl.solve_seconds, len(pl.stages), row["devices"], row["layers"],
                sorted({b for bits in row["bits"] for b in bits}), pl.predicted_throughput_tokens_per_s,
            )  # fmt: skip
            clusters[name][method] = row
    summary = {"digest": digest, "fleet": job.fleet.to_dict(), "model": job.shape.name, "clusters": clusters}
    summary_file.write_text(json.dumps(summary, indent=2) + "\n")
    return {**summary, "cached": False}


def default_workload(
    batch: int = 16, prompt_len: int = 128, output_tokens: int = 128, bits: Sequence[int] = DEFAULT_BITS
) -> Workload:
    return Workload(batch=batch, prompt_len=prompt_len, output_tokens=output_tokens, bits=tuple(bits))
