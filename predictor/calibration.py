"""Online calibration of the length predictor to the model a cluster serves: one place for its rule.

The same prompts get very different lengths from different models, and a served model's lengths are counted in
its own tokenizer. The workers record, per served model, each answered query's pair (the predictor's raw
estimate, the length observed), summed by range of the raw estimate (:mod:`workqueue.length_stats`). From
those sums :class:`Calibration` maps a raw estimate ``x`` to a calibrated one, in log-log space
(``u = log x``; each range ``i`` with ``n_i`` pairs gives its mean raw estimate ``c_i`` and its ratio of sums
``rho_i = observed_i / raw_i``):

1. **A power law** ``calibrated = a x^b``: the weighted (by ``n_i``) least-squares line of ``log rho_i`` on
   ``log c_i``, centred on the pairs' mean ``log c``; its slope ``b - 1`` is shrunk toward 0 by a ridge prior
   of :data:`SLOPE_PRIOR` queries per unit of variance of ``log c``, then ``b`` is kept in
   [:data:`MIN_SLOPE`, :data:`MAX_SLOPE`]. The level ``a`` is then set so the power law's tokens add up to the
   observed ones over all pairs (the token sum is what the gateway adds up).
2. **Per-range corrections**: each range's log ratio minus the power law's, shrunk toward 0 by
   ``n_i / (n_i + RANGE_PRIOR_QUERIES)``: a range with few pairs follows the power law.
3. **Shrinkage toward the identity**: the whole log correction (level, slope and ranges) is multiplied by
   ``N / (N + PRIOR_QUERIES)`` for ``N`` pairs in all: no pairs is the identity, a few pairs move it a little.
4. **Strictly increasing**: the log calibrated values at the range means are made to rise at least
   :data:`MIN_SLOPE` per unit of ``log x`` (weighted pool-adjacent-violators on ``log y - MIN_SLOPE log x``,
   which keeps the weighted mean), interpolated linearly in log-log between them and extended beyond the
   outermost ones with the power law's slope. A longer raw estimate is always calibrated longer, so the
   predictor's ranking (Kendall tau) is kept exactly: no ties are created.

:class:`Calibration` is pure arithmetic; the gateway reads the sums from Redis
(:mod:`gateway.assign.calibrated`). The rule's measurement: ``fleetbatch predictor eval --leave-one-model-out``
(:mod:`predictor.leave_one_out`, docs/design/predictor.md, "Online calibration per served model").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from workqueue.length_stats import N_RANGES, LengthStats

#: pairs of evidence that the identity counts as (the whole correction is scaled by N / (N + this))
PRIOR_QUERIES = 10.0
#: pairs of evidence that the power law counts as in one range's correction
RANGE_PRIOR_QUERIES = 20.0
#: ridge prior on the power law's slope, in pairs per unit of variance of log raw estimate
SLOPE_PRIOR = 5.0
#: the calibrated map's least slope in log-log (strictly increasing) and the power law's largest
MIN_SLOPE = 0.1
MAX_SLOPE = 3.0


def _pav(z: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Weighted least-squares non-decreasing fit of ``z`` (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [weighted mean, weight, length]
    for zi, wi in zip(z.tolist(), w.tolist(), strict=True):
        blocks.append([zi, wi, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, w2, n2 = blocks.pop()
            m1, w1, n1 = blocks.pop()
            wt = w1 + w2
            blocks.append([(m1 * w1 + m2 * w2) / wt, wt, n1 + n2])
    return np.concatenate([np.full(int(n), m) for m, _, n in blocks])


@dataclass(frozen=True)
class Calibration:
    """A strictly increasing map of raw estimates to calibrated ones (the rule in the module docstring)."""

    raw_points: tuple[float, ...]  # increasing raw estimates (the observed ranges' means)
    calibrated_points: tuple[float, ...]  # strictly increasing calibrated values at them
    ratio: float  # calibrated over raw tokens over the observed pairs (1 with no observations)
    observations: float  # pairs it was learned from
    slope: float = 1.0  # log-log slope beyond the outermost points (the power law's b, shrunk)

    @classmethod
    def identity(cls) -> Calibration:
        return cls((1.0,), (1.0,), 1.0, 0.0)

    @classmethod
    def from_stats(
        cls,
        stats: LengthStats,
        prior: float = PRIOR_QUERIES,
        range_prior: float = RANGE_PRIOR_QUERIES,
        slope_prior: float = SLOPE_PRIOR,
    ) -> Calibration:
        idx = [i for i in range(N_RANGES) if stats.n[i] > 0 and stats.raw[i] > 0 and stats.observed[i] > 0]
        if not idx:
            return cls.identity()
        n = np.array([stats.n[i] for i in idx], dtype=np.float64)
        raw = np.array([stats.raw[i] for i in idx], dtype=np.float64)
        obs = np.array([stats.observed[i] for i in idx], dtype=np.float64)
        total = float(n.sum())
        u = np.log(raw / n)  # log mean raw estimate per range
        lr = np.log(obs / raw)  # log ratio of sums per range
        u0 = float(np.average(u, weights=n))
        du = u - u0
        beta = float(np.sum(n * du * (lr - np.average(lr, weights=n)))) / (
            float(np.sum(n * du * du)) + slope_prior
        )
        beta = min(max(beta, MIN_SLOPE - 1.0), MAX_SLOPE - 1.0)
        # the level: the power law's tokens add up to the observed ones (raw of a range taken at its mean)
        alpha = math.log(obs.sum() / float(np.sum(raw * np.exp(beta * du))))
        fit = alpha + beta * du
        resid = (lr - fit) * n / (n + range_prior)
        shrink = total / (total + prior)
        log_ratio = shrink * (fit + resid)
        log_y = u + log_ratio
        z = _pav(log_y - MIN_SLOPE * u, n)  # strictly increasing: slope >= MIN_SLOPE between points
        log_y = z + MIN_SLOPE * u
        ys = np.exp(log_y)
        slope = 1.0 + shrink * beta
        ratio = float(np.sum(n * ys) / raw.sum())
        return cls(tuple(map(float, np.exp(u))), tuple(map(float, ys)), ratio, total, float(slope))

    @property
    def is_identity(self) -> bool:
        return self.observations <= 0

    def apply(self, raw: Sequence[float] | np.ndarray) -> np.ndarray:
        """Calibrated estimates of ``raw`` (tokens; the same shape, float64; non-positive values as they are)."""
        x = np.asarray(raw, dtype=np.float64)
        if self.is_identity:
            return x.copy()
        lxs = np.log(np.asarray(self.raw_points))
        lys = np.log(np.asarray(self.calibrated_points))
        lx = np.log(np.maximum(x, 1e-9))
        out = np.interp(lx, lxs, lys)
        low, high = lx < lxs[0], lx > lxs[-1]  # beyond the outermost points: the power law's slope
        out[low] = lys[0] + self.slope * (lx[low] - lxs[0])
        out[high] = lys[-1] + self.slope * (lx[high] - lxs[-1])
        return np.where(x > 0, np.exp(out), x)

    def describe(self) -> str:
        if self.is_identity:
            return "identity (no observed lengths yet)"
        return (
            f"x{self.ratio:.3f} overall (log-log slope {self.slope:.2f}), "
            f"from {self.observations:.0f} observed answers"
        )


def calibration_of(stats: LengthStats) -> Calibration:
    """:meth:`Calibration.from_stats` with the default shrinkage."""
    return Calibration.from_stats(stats)
