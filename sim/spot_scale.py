"""``fleetbatch sim spot-scale``: the scale run with prices and a synthetic preemption process, timed side by side
with the plain simulator on the same run.

The fleet is :func:`sim.study.fleet`'s (``--num-clusters`` iteration-level clusters at speeds repeating ``1:2:4``),
each speed standing for a cluster of the spot benchmark's (:mod:`load.studies.spot`): speed 4 for 2 x A100-40G on
demand, 2 for V100-32G + T4 and 1 for 2 x T4, both on spot, priced by the device catalog
(:func:`clusterfile.prices.cluster_price_per_hour`). The workload is the scale run's (``--num-queries`` resampled
from the generated mix, all at once).

First the plain :class:`sim.core.Simulator` (today's scale run: no prices, no events) gives the makespan ``T``.
Then :class:`sim.spot.SpotSimulator` runs the same queries on the same fleet with the prices, the batch's window
(``--window`` x ``T``) and outages drawn by a Poisson process: each spot cluster is preempted
``--preempts-per-hour`` times an hour of simulated time on average until ``T`` (a share ``--kill-share`` of them
hard kills, the others with ``--notice`` seconds of notice), and is back ``--back-after`` seconds after its engine
stopped. Both runs are timed in CPU seconds of this process (``time.process_time``: the other processes on
the machine do not count), ``--repeats`` times each, alternately; ``sim_cpu_ratio`` is the spot run's median over
the plain run's.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Sequence

from clusterfile.prices import cluster_price_per_hour
from gateway.assign.cost import SPOT_MARGIN
from sim.core import ClusterSpec, SimConfig, Simulator
from sim.result import SimResult
from sim.spot import Market, Outage, SpotSimulator
from sim.study import StudySetup, fleet
from sim.workload import Workload, bootstrap, load_workload

#: the devices and market each speed stands for
SPEED_CLUSTERS: dict[float, tuple[list[str], str]] = {
    4.0: (["A100-40G", "A100-40G"], "on-demand"),
    2.0: (["V100-32G", "T4"], "spot"),
    1.0: (["T4", "T4"], "spot"),
}


def market_of(
    specs: Sequence[ClusterSpec],
    speeds: Sequence[float],
    window_s: float | None,
    spot_margin: float = SPOT_MARGIN,
) -> Market:
    """The prices and spot clusters of a :func:`sim.study.fleet` whose speeds repeat ``speeds``."""
    prices, spot = {}, set()
    for i, s in enumerate(specs):
        speed = speeds[i % len(speeds)]
        if speed not in SPEED_CLUSTERS:
            raise ValueError(
                f"no devices stand for speed {speed}; the spot scale run takes speeds of {list(SPEED_CLUSTERS)}"
            )
        devices, market = SPEED_CLUSTERS[speed]
        prices[s.name] = cluster_price_per_hour(None, devices, market)
        if market == "spot":
            spot.add(s.name)
    return Market(prices=prices, spot=frozenset(spot), window_s=window_s, spot_margin=spot_margin)


def preemptions(
    spot: Sequence[str],
    horizon_s: float,
    per_hour: float,
    notice_s: float,
    back_after_s: float,
    kill_share: float,
    seed: int,
) -> list[Outage]:
    """Each spot cluster's outages until ``horizon_s``: a Poisson process of ``per_hour`` an hour, each back
    ``back_after_s`` after its engine stopped (a cluster is not preempted again before it is back)."""
    if per_hour < 0 or notice_s < 0 or back_after_s < 0 or not 0 <= kill_share <= 1:
        raise ValueError("preemptions: rates and seconds must be >= 0 and kill_share in [0, 1]")
    rng = random.Random(seed)
    out = []
    for name in sorted(spot):
        t = 0.0
        while per_hour > 0:
            t += rng.expovariate(per_hour / 3600.0)
            if t >= horizon_s:
                break
            kill = rng.random() < kill_share
            stop = t if kill else t + notice_s
            out.append(
                Outage(name, t, "kill" if kill else "preempt", 0.0 if kill else notice_s, stop + back_after_s)
            )
            t = stop + back_after_s
    return sorted(out, key=lambda o: (o.t, o.cluster))


def _timed(sim: Simulator, progress: bool) -> tuple[SimResult, float]:
    c0 = time.process_time()
    result = sim.run(progress=progress)
    return result, time.process_time() - c0


def scale_spot(
    clusters: int,
    queries: int,
    batch: int,
    setup: StudySetup,
    seed: int = 0,
    policy: str = "token",
    per_hour: float = 6.0,
    notice_s: float = 1.0,
    back_after_s: float = 60.0,
    kill_share: float = 0.2,
    window: float = 2.0,
    repeats: int = 3,
    progress: bool = False,
    spot_margin: float = SPOT_MARGIN,
) -> dict:
    """The plain run and the spot run of the same queries and fleet (module docstring); the last line's object."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, not {repeats}")
    work: Workload = bootstrap(load_workload("generated", 20000, seed, setup.max_tokens), queries, seed)
    specs = fleet(clusters, setup.speeds, setup, "iteration", batch)
    cfg = SimConfig(policy="token", offload=setup.offload, max_tokens=setup.max_tokens)
    plain_cpu, spot_cpu = [], []
    plain, cpu = _timed(Simulator(specs, work, cfg), progress)
    plain_cpu.append(cpu)
    market = market_of(specs, setup.speeds, window * plain.makespan_s, spot_margin)
    outages = preemptions(
        sorted(market.spot), plain.makespan_s, per_hour, notice_s, back_after_s, kill_share, seed
    )
    spot_cfg = SimConfig(policy=policy, offload=setup.offload, max_tokens=setup.max_tokens)
    for i in range(repeats):  # alternately, so that a slow spell of the machine falls on both
        if i:
            plain_cpu.append(_timed(Simulator(specs, work, cfg), progress)[1])
        spot, cpu = _timed(SpotSimulator(specs, work, spot_cfg, market, outages), progress)
        spot_cpu.append(cpu)
    a, b = statistics.median(spot_cpu), statistics.median(plain_cpu)
    return {
        "clusters": clusters,
        "queries": queries,
        "policy": policy,
        "spot_clusters": len(market.spot),
        "outages": len(outages),
        "kills": sum(o.kind == "kill" for o in outages),
        "plain_makespan_s": round(plain.makespan_s, 1),
        "spot_makespan_s": round(spot.makespan_s, 1),
        "window_s": round(window * plain.makespan_s, 1),
        "deadline_met": spot.makespan_s <= window * plain.makespan_s,
        "spot_cost_dollars": round(spot.cost_dollars or 0.0, 4),
        **(spot.spot or {}),
        "sim_cpu_seconds_plain": round(b, 2),
        "sim_cpu_seconds": round(a, 2),
        "sim_cpu_ratio": round(a / b, 3) if b > 0 else None,
        "cpu_seconds_each": {
            "plain": [round(x, 2) for x in plain_cpu],
            "spot": [round(x, 2) for x in spot_cpu],
        },
    }
