"""``fleetbatch planner compare``: our plan against the Uniform and Het baselines on many clusters and models.

For each (cluster, model) the baselines are planned first; ours is then solved with the total
omega capped at the smallest omega of the baselines that fit, so its quality is no worse than
theirs, and its modelled throughput is divided by the best fitting baseline's. Each row also
gives the most any pipeline-parallel plan could gain at that omega cap under the same cost model
(``planner.bound``): the baseline's latency over a lower bound on any plan's latency; and the
same with tensor-parallel stages allowed. Ours may use tensor-parallel stages (``tp_sizes``);
the baselines stay pipeline-only, as in the papers' comparison.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from tqdm import tqdm

from planner.baselines import het, uniform
from planner.bound import pipeline_latency_bound
from planner.cluster import load_cluster
from planner.costs import Workload
from planner.modelshape import load_shape
from planner.problem import build_problem
from planner.search import micro_batch_candidates, plan, prefill_chunk_candidates

log = logging.getLogger(__name__)


@dataclass
class CompareRow:
    cluster: str
    model: str
    uniform_tput: float | None
    uniform_omega: float | None
    het_tput: float | None
    het_omega: float | None
    ours_tput: float | None
    ours_omega: float | None
    ours_stages: int | None
    ours_bits: str
    speedup: float | None
    solve_s: float
    speedup_bound: float | None = None
    kappa: int | None = None
    ours_tp: str = ""  # tensor-parallel degree of each stage, e.g. "4" or "2+1+1"
    speedup_bound_tp: float | None = None  # the bound over plans with TP stages too

    def to_dict(self) -> dict:
        return self.__dict__.copy()


def compare_one(
    cluster: str,
    model: str,
    workload: Workload,
    time_limit_s: float,
    seed: int = 0,
    group_size: int | None = None,
    kappas: Sequence[int] | None = None,
    tp_sizes: Sequence[int] = (1, 2, 4),
) -> CompareRow:
    problem = build_problem(load_cluster(cluster), load_shape(model), workload, seed=seed)
    base = {"uniform": uniform(problem), "het": het(problem)}
    fitting = {k: v for k, v in base.items() if v is not None}
    budget = min(e.omega for _, e in fitting.values()) if fitting else None
    starts = [a for a, _ in fitting.values()]
    r = plan(
        problem,
        "ilp",
        time_limit_s=time_limit_s,
        omega_budget=budget,
        starts=starts,
        group_size=group_size,
        kappas=list(kappas) if kappas else None,
        tp_sizes=tp_sizes,
    )
    best_base = max((e.throughput for _, e in fitting.values()), default=None)
    speedup = r.evaluation.throughput / best_base if (r is not None and best_base) else None
    bits = sorted(set(r.assignment.bits)) if r else []
    bound = bound_tp = None
    if best_base:
        n_dev = len(problem.cluster.devices)
        mbs = sorted({pr for S in range(1, n_dev + 1) for pr in micro_batch_candidates(problem, S)})
        ks = list(kappas) if kappas else prefill_chunk_candidates(problem)
        lb = pipeline_latency_bound(problem, budget, mbs, ks)
        base_latency = workload.batch * workload.output_tokens / best_base
        bound = base_latency / lb if lb > 0 else None
        if any(t > 1 for t in tp_sizes):
            lbt = pipeline_latency_bound(problem, budget, mbs, ks, tp_sizes)
            bound_tp = base_latency / lbt if lbt > 0 else None

    def tput(k: str) -> float | None:
        return base[k][1].throughput if base[k] else None

    def om(k: str) -> float | None:
        return base[k][1].omega if base[k] else None

    return CompareRow(
        cluster,
        model,
        tput("uniform"),
        om("uniform"),
        tput("het"),
        om("het"),
        r.evaluation.throughput if r else None,
        r.evaluation.omega if r else None,
        len(r.assignment.order) if r else None,
        "/".join(map(str, bits)),
        speedup,
        r.solve_seconds if r else 0.0,
        bound,
        r.assignment.kappa if r else None,
        "+".join(str(problem.unit_tp(u)) for u in r.assignment.order) if r else "",
        bound_tp,
    )


def run_compare(
    clusters: Sequence[str],
    models: Sequence[str],
    workload: Workload,
    time_limit_s: float = 6.0,
    progress: bool = True,
    group_size: int | None = None,
    kappas: Sequence[int] | None = None,
    tp_sizes: Sequence[int] = (1, 2, 4),
) -> tuple[list[CompareRow], dict]:
    rows = []
    jobs = [(c, m) for c in clusters for m in models]
    for c, m in tqdm(jobs, desc="compare", disable=not progress):
        row = compare_one(
            c, m, workload, time_limit_s, group_size=group_size, kappas=kappas, tp_sizes=tp_sizes
        )
        log.info("%s %s: speedup %s, solve %.2fs", c, m, row.speedup, row.solve_s)
        rows.append(row)
    speedups = [r.speedup for r in rows if r.speedup is not None]
    bounds = [r.speedup_bound for r in rows if r.speedup is not None and r.speedup_bound is not None]
    bounds_tp = [r.speedup_bound_tp for r in rows if r.speedup is not None and r.speedup_bound_tp is not None]
    summary = {
        "pairs": len(rows),
        "pairs_with_fitting_baseline": len(speedups),
        "pairs_only_ours_fits": sum(1 for r in rows if r.speedup is None and r.ours_tput is not None),
        "pairs_nothing_fits": sum(
            1 for r in rows if r.ours_tput is None and r.uniform_tput is None and r.het_tput is None
        ),
        "pairs_ours_missing_but_baseline_fits": sum(
            1 for r in rows if r.ours_tput is None and (r.uniform_tput is not None or r.het_tput is not None)
        ),
        "mean_speedup_vs_best_baseline": statistics.fmean(speedups) if speedups else None,
        "max_speedup_vs_best_baseline": max(speedups) if speedups else None,
        "min_speedup_vs_best_baseline": min(speedups) if speedups else None,
        "mean_speedup_upper_bound": statistics.fmean(bounds) if bounds else None,
        "mean_speedup_upper_bound_tp": statistics.fmean(bounds_tp) if bounds_tp else None,
        "pairs_using_tp": sum(1 for r in rows if any(x != "1" for x in r.ours_tp.split("+") if x)),
        "tp_sizes": sorted(set(tp_sizes)),
        "max_solve_seconds": max(r.solve_s for r in rows) if rows else 0.0,
        "mean_solve_seconds": statistics.fmean(r.solve_s for r in rows) if rows else 0.0,
        "batch": workload.batch,
        "prompt_len": workload.prompt_len,
        "output_tokens": workload.output_tokens,
    }
    return rows, summary


def _f(x: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def markdown_table(rows: Sequence[CompareRow]) -> str:
    head = (
        "| cluster | model | Uniform tok/s | Het tok/s | ours tok/s | ours bits | stages (TP) | "
        "omega ours / best-base cap | kappa | speedup | PP bound | PP+TP bound | solve s |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        caps = [x for x in (r.uniform_omega, r.het_omega) if x is not None]
        cap = min(caps) if caps else None
        lines.append(
            f"| {r.cluster} | {r.model} | {_f(r.uniform_tput)} | {_f(r.het_tput)} | {_f(r.ours_tput)} | {r.ours_bits or '-'} | "
            f"{r.ours_stages or '-'} ({r.ours_tp or '-'}) | {_f(r.ours_omega, '{:.0f}')} / {_f(cap, '{:.0f}')} | "
            f"{r.kappa or '-'} | {_f(r.speedup, '{:.2f}x')} | {_f(r.speedup_bound, '{:.2f}x')} | "
            f"{_f(r.speedup_bound_tp, '{:.2f}x')} | {r.solve_s:.2f} |"
        )
    return head + "\n".join(lines) + "\n"


def plot_speedups(rows: Sequence[CompareRow], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r.cluster}\n{r.model}" for r in rows]
    vals = [r.speedup or 0.0 for r in rows]
    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 0.45), 4))
    ax.bar(range(len(rows)), vals)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(rows)), labels, rotation=90, fontsize=6)
    ax.set_ylabel("throughput / best baseline")
    ax.set_title("planner (ILP) vs best of Uniform/Het at no worse total omega (0 = no baseline fits)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
