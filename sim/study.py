"""MICO's study in cost-model time, the cluster sweep, and the 100-cluster x 1,000,000-query scale run.

The four combinations are {``round_robin``, ``token``} x {static batches, iteration-level}
(``static`` / ``iteration`` engines of :mod:`sim.engines`), on the same workload, fleet and seed.
Fleets: ``n`` equal clusters, and ``n`` clusters whose speeds repeat ``1:2:4``. Ratios:

* ``qi_over_rr_static`` -- throughput of token + iteration over round robin + static, equal clusters;
* ``qi_over_rr_iteration_unequal`` -- token over round robin, both iteration-level, 1:2:4 speeds;
* ``kv_ratio_iteration_vs_static`` -- cumulative KV (token-seconds) of iteration-level over static
  batching, both with the token policy, equal clusters (MICO: 44.89 % less).

Each ratio is the geometric mean over the grid of engine batch sizes x batch lengths (queries per
batch); the grid's spread is reported with it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from load.arrivals import arrivals as arrival_times
from localmodels import default_tokenizer
from sim.core import ClusterSpec, SimConfig, SimResult, Simulator
from sim.costs import LinearCost
from sim.workload import Workload, bootstrap, load_workload

COMBOS = (
    ("round_robin", "static"),
    ("round_robin", "iteration"),
    ("token", "static"),
    ("token", "iteration"),
)


@dataclass(frozen=True)
class StudySetup:
    cost: LinearCost = LinearCost()
    kv_budget_tokens: int = 16384
    offload: bool = True
    speeds: tuple[float, ...] = (1.0, 2.0, 4.0)
    max_tokens: int = 256


def fleet(k: int, speeds: Sequence[float], setup: StudySetup, backend: str, batch: int) -> list[ClusterSpec]:
    """``k`` clusters whose speeds repeat ``speeds``."""
    return [
        ClusterSpec(
            f"c{i}",
            setup.cost.with_speed(speeds[i % len(speeds)]),
            backend,
            batch,
            setup.kv_budget_tokens,
        )
        for i in range(k)
    ]


def run_one(
    work: Workload, k: int, speeds: Sequence[float], policy: str, backend: str, batch: int, setup: StudySetup
) -> SimResult:
    cfg = SimConfig(policy=policy, offload=setup.offload, max_tokens=setup.max_tokens)
    return Simulator(fleet(k, speeds, setup, backend, batch), work, cfg).run()


def _geomean(xs: Iterable[float]) -> float:
    xs = list(xs)
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def combos(work: Workload, k: int, speeds: Sequence[float], batch: int, setup: StudySetup) -> dict[str, dict]:
    """The four combinations on one fleet: ``{"token+iteration": summary, ...}``."""
    out = {}
    for policy, backend in COMBOS:
        r = run_one(work, k, speeds, policy, backend, batch, setup)
        out[f"{policy}+{backend}"] = r.summary()
    return out


def ratios(equal: dict[str, dict], unequal: dict[str, dict]) -> dict[str, float]:
    tput = lambda d, key: d[key]["throughput_tokens_per_s"]  # noqa: E731
    return {
        "qi_over_rr_static": tput(equal, "token+iteration") / tput(equal, "round_robin+static"),
        "qi_over_rr_iteration_unequal": tput(unequal, "token+iteration")
        / tput(unequal, "round_robin+iteration"),
        "kv_ratio_iteration_vs_static": equal["token+iteration"]["kv_token_seconds"]
        / equal["token+static"]["kv_token_seconds"],
        "kv_ratio_iteration_vs_static_cached": equal["token+iteration"]["kv_cached_token_seconds"]
        / equal["token+static"]["kv_cached_token_seconds"],
    }


def study(
    workloads: dict[int, Workload],
    batches: Sequence[int],
    cluster_counts: Sequence[int],
    setup: StudySetup,
    reference_batch: int,
    progress: bool = False,
) -> dict:
    """The grid on 3 clusters (ratios), then the four combinations at 3, 6, 9... clusters."""
    from tqdm import tqdm

    t0 = time.perf_counter()
    grid = []
    runs = len(workloads) * len(batches) + len(cluster_counts)
    bar = tqdm(total=runs, disable=not progress, desc="study", unit="fleet pair")
    for n, work in workloads.items():
        for b in batches:
            eq = combos(work, 3, (1.0,), b, setup)
            un = combos(work, 3, setup.speeds, b, setup)
            grid.append({"queries": n, "batch": b, **{k: round(v, 4) for k, v in ratios(eq, un).items()}})
            bar.update(1)
    ref_n = max(workloads)
    ref = workloads[ref_n]
    per_k = {}
    for k in cluster_counts:
        eq = combos(ref, k, (1.0,), reference_batch, setup)
        un = combos(ref, k, setup.speeds, reference_batch, setup)
        per_k[str(k)] = {
            "equal": eq,
            "unequal": un,
            **{key: round(v, 4) for key, v in ratios(eq, un).items()},
        }
        bar.update(1)
    bar.close()
    keys = (
        "qi_over_rr_static",
        "qi_over_rr_iteration_unequal",
        "kv_ratio_iteration_vs_static",
        "kv_ratio_iteration_vs_static_cached",
    )
    out: dict = {k: round(_geomean(g[k] for g in grid), 4) for k in keys}
    for k in keys:
        out[f"{k}_range"] = [min(g[k] for g in grid), max(g[k] for g in grid)]
    base = per_k.get("3") or next(iter(per_k.values()))
    out["reference"] = {"queries": ref_n, "batch": reference_batch, "clusters": 3}
    for combo, s in base["equal"].items():
        out[f"makespan_s[{combo}]"] = s["makespan_s"]
        out[f"throughput_tokens_per_s[{combo}]"] = s["throughput_tokens_per_s"]
        out[f"kv_token_seconds[{combo}]"] = s["kv_token_seconds"]
        out[f"kv_cached_token_seconds[{combo}]"] = s["kv_cached_token_seconds"]
    out["grid"] = grid
    out["clusters"] = per_k
    out["study_seconds"] = round(time.perf_counter() - t0, 2)
    return out


def make_workloads(
    name: str,
    sizes: Sequence[int],
    seed: int,
    max_tokens: int,
    arrivals: str,
    rate: float,
    scale: float = 1.0,
    trace: str = "conv",
) -> dict[int, Workload]:
    """One workload per batch length (the largest drawn once, the others its prefixes), with
    arrival times of process ``arrivals`` (:func:`load.arrivals.arrivals`)."""
    tokenizer = None
    if name == "mixed":
        tokenizer = default_tokenizer()
    big = load_workload(name, max(sizes), seed, max_tokens, tokenizer)
    out = {}
    for n in sorted(set(sizes)):
        w = Workload(
            big.prompt_tokens[:n], big.true_tokens[:n], big.predicted_tokens[:n], [0.0] * n, big.source
        )
        if arrivals != "all":
            w = w.with_arrivals(arrival_times(arrivals, n, rate=rate, scale=scale, trace=trace, seed=seed))
        out[n] = w
    return out


def scale(
    clusters: int,
    queries: int,
    batch: int,
    setup: StudySetup,
    seed: int = 0,
    policy: str = "token",
    progress: bool = False,
) -> dict:
    """``queries`` queries (resampled from the generated workload) on ``clusters`` iteration-level clusters."""
    t0 = time.perf_counter()
    work = bootstrap(load_workload("generated", 20000, seed, setup.max_tokens), queries, seed)
    built = time.perf_counter() - t0
    specs = fleet(clusters, setup.speeds, setup, "iteration", batch)
    sim = Simulator(specs, work, SimConfig(policy=policy, offload=setup.offload, max_tokens=setup.max_tokens))
    c0 = time.process_time()
    result = sim.run(progress=progress)
    cpu = time.process_time() - c0
    out = {
        "clusters": clusters,
        "queries": queries,
        "batch": batch,
        "policy": policy,
        "speeds": list(setup.speeds),
        **result.summary(),
        "sim_cpu_seconds": round(cpu, 2),
        "workload_seconds": round(built, 2),
        "steps": sum(c["steps"] for c in result.per_cluster.values()),
    }
    out["sim_seconds"] = out.pop("wall_s")
    if clusters == 100 and queries == 1_000_000:
        out["sim_seconds_100x1m"] = out["sim_seconds"]
    return out
