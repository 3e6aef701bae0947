"""A cluster's capacity in tokens/s: the plan's (or configured hint's) figure corrected by measurement.

Rule of :func:`effective_capacity`:

1. The *prior* is the plan's predicted throughput when known, else the capacity hint of
   the cluster config.
2. A *measurement* is the throughput reported by heartbeats while the cluster was busy
   (the caller must not feed samples from idle periods: an idle cluster's rate says
   nothing about its capacity). Missing, zero or negative measurements are ignored.
3. Both known: ``alpha * measured + (1 - alpha) * prior`` (``alpha`` in [0, 1] is the trust
   in measurement). Only one known: that one. Neither: :data:`FALLBACK_TPS`, a small
   positive figure, so an unknown cluster gets a small share at first and grows as
   offloading feeds it and its heartbeats report a measured rate.

The result is always > 0.
"""

from __future__ import annotations

import math

FALLBACK_TPS = 1.0


def _known(name: str, v: float | None) -> float | None:
    if v is None:
        return None
    if not isinstance(v, int | float) or math.isnan(v) or math.isinf(v):
        raise ValueError(f"{name} must be a finite number or None, not {v!r}")
    if v < 0:
        raise ValueError(f"{name} must be >= 0, not {v}")
    return float(v) if v > 0 else None


def effective_capacity(
    plan_tps: float | None, measured_tps: float | None, hint_tps: float | None, alpha: float = 0.5
) -> float:
    """Blend plan/hint capacity with the measured heartbeat throughput (rule in the module docstring)."""
    if not (isinstance(alpha, int | float) and 0.0 <= alpha <= 1.0):
        raise ValueError(f"alpha must be in [0, 1], not {alpha!r}")
    plan = _known("plan_tps", plan_tps)
    hint = _known("hint_tps", hint_tps)
    measured = _known("measured_tps", measured_tps)
    prior = plan if plan is not None else hint
    if prior is not None and measured is not None:
        value = alpha * measured + (1.0 - alpha) * prior
        return value if value > 0 else FALLBACK_TPS
    if prior is not None:
        return prior
    if measured is not None:
        return measured
    return FALLBACK_TPS
