"""Arrival processes for studies: all at once, Poisson, or replayed Azure production timestamps.

Each returns ``n`` arrival times in seconds from the first (``[0.0, ...]``, non-decreasing):

* ``all`` -- every query at time 0 (an offline batch);
* ``poisson`` -- exponential gaps at ``rate`` queries per second, drawn from ``seed``;
* ``azure`` -- the gaps between consecutive requests of the Azure LLM inference trace
  (``../shared/data/azure_trace``, ``conv`` or ``code``), starting at a row chosen by ``seed``,
  multiplied by ``scale`` (below 1 replays the trace faster than it happened).

Used by ``fleetbatch loadgen study --arrivals`` (real runs submit each arrival group when its time comes)
and by the simulator (``python -m sim.cli study --arrivals``).
"""

from __future__ import annotations

import argparse
import random
from datetime import datetime
from pathlib import Path

import numpy as np

from fleetdata.datasets import load_azure_trace

KINDS = ("all", "poisson", "azure")


def poisson_arrivals(n: int, rate_per_s: float, seed: int = 0) -> list[float]:
    """Arrival times of a Poisson process of ``rate_per_s`` queries per second, starting at 0."""
    if not rate_per_s > 0:
        raise ValueError(f"arrival rate must be > 0, not {rate_per_s}")
    if n <= 0:
        return []
    gaps = np.random.default_rng(seed).exponential(1.0 / rate_per_s, n)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


def _seconds(timestamp: str) -> float:
    """``2023-11-16 18:17:03.9799600`` (seven fractional digits) as POSIX seconds."""
    whole, _, frac = timestamp.strip().partition(".")
    return datetime.fromisoformat(whole).timestamp() + (float("0." + frac) if frac else 0.0)


def azure_arrivals(
    n: int, kind: str = "conv", scale: float = 1.0, seed: int = 0, root: Path | None = None
) -> list[float]:
    """``n`` consecutive arrivals of the Azure trace from a row drawn by ``seed``, gaps x ``scale``."""
    if not scale > 0:
        raise ValueError(f"arrival scale must be > 0, not {scale}")
    rows = load_azure_trace(kind, root)
    if n > len(rows):
        raise ValueError(f"the azure {kind} trace has {len(rows)} requests; {n} asked")
    start = random.Random(seed).randrange(len(rows) - n + 1)
    times = sorted(_seconds(r["timestamp"]) for r in rows[start : start + n])
    return [(t - times[0]) * scale for t in times]


def arrivals(
    kind: str, n: int, *, rate: float = 20.0, scale: float = 1.0, trace: str = "conv", seed: int = 0
) -> list[float]:
    """``n`` arrival times of process ``kind`` (one of :data:`KINDS`)."""
    if kind == "all":
        return [0.0] * n
    if kind == "poisson":
        return poisson_arrivals(n, rate, seed)
    if kind == "azure":
        return azure_arrivals(n, trace, scale, seed)
    raise ValueError(f"arrivals must be one of {', '.join(KINDS)}, not {kind!r}")


def add_arrival_arguments(p: argparse.ArgumentParser) -> None:
    """``--arrivals``, ``--rate``, ``--arrival-scale`` and ``--trace`` (shared by the study and the simulator)."""
    p.add_argument(
        "--arrivals",
        choices=KINDS,
        default="all",
        help="all at once (an offline batch), Poisson at --rate, or the Azure trace's timestamps (default all)",
    )
    p.add_argument("--rate", type=float, default=20.0, help="Poisson arrivals per second (default 20)")
    p.add_argument(
        "--arrival-scale",
        type=float,
        default=1.0,
        help="azure: multiply the trace's gaps (0.5 replays it twice as fast; default 1)",
    )
    p.add_argument(
        "--trace", choices=("conv", "code"), default="conv", help="azure: which trace (default conv)"
    )


def groups(times: list[float], tick_s: float) -> list[tuple[float, list[int]]]:
    """Queries grouped by arrival: ``(time, indices)`` for each ``tick_s`` window that has any,
    in time order (what a client submits as one batch when the window's first query arrives)."""
    if not tick_s > 0:
        raise ValueError(f"tick must be > 0, not {tick_s}")
    by: dict[int, list[int]] = {}
    for i, t in enumerate(times):
        by.setdefault(int(t // tick_s), []).append(i)
    return [(min(times[i] for i in idx), idx) for _, idx in sorted(by.items())]
