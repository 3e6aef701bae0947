"""Length buckets: edges, labels, representative token counts, and expected tokens from probabilities.

Two schemes:

* ``uniform`` (MICO): ``N`` buckets of width ``l_max / N``; label ``floor(l / (l_max / N))``,
  lengths at or above ``l_max`` go to the last bucket.
* ``quantile``: edges at the quantiles of the training lengths, so each bucket holds about
  the same number of training answers (ties can merge buckets, so there may be fewer than ``N``).

Each bucket has a midpoint (MICO's point estimate), a representative value (the mean
training length of the bucket), which the probability-weighted expectation uses, and a
small table of within-bucket training-length quantiles, which the predictive median (and
any other predictive quantile) interpolates in.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

SCHEMES = ("uniform", "quantile")
WITHIN_POINTS = 17  # within-bucket quantile levels stored per bucket: 0, 1/16, ..., 1


def _as_lengths(lengths: Sequence[float] | np.ndarray) -> np.ndarray:
    arr = np.asarray(lengths, dtype=np.float64).reshape(-1)
    if arr.size and (np.isnan(arr).any() or (arr < 0).any()):
        raise ValueError("response lengths must be non-negative numbers")
    return arr


@dataclass(frozen=True)
class Buckets:
    """Bucket edges (``n + 1`` increasing numbers, first 0) with per-bucket representative token counts."""

    edges: tuple[float, ...]
    values: tuple[float, ...]
    scheme: str = "quantile"
    calibration: float = 1.0  # multiplier on the expectation so batch sums match (fit on validation data)
    # Per bucket, training lengths at the within-bucket quantile levels linspace(0, 1, m) (non-decreasing,
    # inside the bucket's edges); None: lengths are taken as uniform between the edges.
    within: tuple[tuple[float, ...], ...] | None = None

    def __post_init__(self) -> None:
        if len(self.edges) < 2:
            raise ValueError("buckets need at least two edges")
        if any(b <= a for a, b in zip(self.edges, self.edges[1:], strict=False)):
            raise ValueError(f"bucket edges must increase strictly: {self.edges}")
        if len(self.values) != len(self.edges) - 1:
            raise ValueError(f"{len(self.edges) - 1} buckets but {len(self.values)} representative values")
        if self.scheme not in SCHEMES:
            raise ValueError(f"unknown bucket scheme {self.scheme!r}; choose one of {', '.join(SCHEMES)}")
        if not (self.calibration > 0 and math.isfinite(self.calibration)):
            raise ValueError(f"calibration factor must be positive, not {self.calibration}")
        if self.within is not None:
            if (
                len(self.within) != self.n
                or len({len(w) for w in self.within}) != 1
                or len(self.within[0]) < 2
            ):
                raise ValueError("within-bucket quantiles need one table of at least 2 points per bucket")
            if any(np.any(np.diff(w) < 0) for w in self.within):
                raise ValueError("within-bucket quantiles must be non-decreasing")

    @property
    def n(self) -> int:
        return len(self.edges) - 1

    @property
    def midpoints(self) -> np.ndarray:
        e = np.asarray(self.edges)
        return (e[:-1] + e[1:]) / 2.0

    def label(self, lengths: Sequence[float] | np.ndarray) -> np.ndarray:
        """Bucket index of each length; below the first edge -> 0, at or above the last -> ``n - 1``."""
        arr = _as_lengths(lengths)
        inner = np.asarray(self.edges[1:-1])
        return np.searchsorted(inner, arr, side="right").astype(np.int64)

    def expected(self, probs: np.ndarray, calibrated: bool = True) -> np.ndarray:
        """Probability-weighted expectation of tokens, ``probs`` of shape ``(batch, n)``."""
        probs = self._check(probs)
        out = probs @ np.asarray(self.values)
        return out * self.calibration if calibrated else out

    def midpoint(self, buckets: np.ndarray) -> np.ndarray:
        """MICO's estimate: the midpoint of each given bucket."""
        return self.midpoints[np.asarray(buckets, dtype=np.int64)]

    def quantile(self, probs: np.ndarray, q: float = 0.5) -> np.ndarray:
        """The ``q``-quantile of each predictive distribution (``probs`` of shape ``(batch, n)``).

        The distribution is the bucket probabilities spread within each bucket like the training
        lengths of that bucket (``within``; uniformly between the edges when absent): find the
        bucket where the cumulative probability crosses ``q``, then interpolate the within-bucket
        quantile function at the remaining fraction. Not calibrated: ``q = 0.5`` gives the
        predictive median, the point estimate that minimises the expected absolute error.
        """
        if not 0.0 < q < 1.0:
            raise ValueError(f"quantile level must be in (0, 1), not {q}")
        probs = self._check(probs)
        if not len(probs):
            return np.zeros(0)
        probs = probs / probs.sum(1, keepdims=True)
        cum = np.cumsum(probs, axis=1)
        k = np.minimum((cum < q).sum(1), self.n - 1)  # first bucket whose cumulative probability reaches q
        rows = np.arange(len(probs))
        before = np.where(k > 0, cum[rows, np.maximum(k - 1, 0)], 0.0)
        p_k = probs[rows, k]
        u = np.clip(np.divide(q - before, p_k, out=np.full(len(k), 0.5), where=p_k > 0), 0.0, 1.0)
        if self.within is None:
            e = np.asarray(self.edges)
            return e[k] + u * (e[k + 1] - e[k])
        table = np.asarray(self.within)  # (n, m)
        pos = u * (table.shape[1] - 1)
        lo = np.floor(pos).astype(np.int64).clip(0, table.shape[1] - 2)
        frac = pos - lo
        return table[k, lo] * (1 - frac) + table[k, lo + 1] * frac

    def cdf(self, probs: np.ndarray, x: float) -> np.ndarray:
        """``P(length < x)`` under each predictive distribution (the distribution of :meth:`quantile`)."""
        return self._normalised(probs) @ self._share_below(x)

    def mass_in(self, probs: np.ndarray, edges: Sequence[float]) -> np.ndarray:
        """Predictive probability of each interval of another bucketing ``edges`` ``(batch, len(edges) - 1)``.

        The last interval takes everything above its lower edge, as a bucket label does, so a
        fine-grained model answers for a coarser bucketing (e.g. MICO's uniform buckets).
        """
        edges = np.asarray(edges, dtype=np.float64)
        if edges.ndim != 1 or len(edges) < 2 or np.any(np.diff(edges) <= 0):
            raise ValueError(f"edges must be at least two strictly increasing numbers, not {edges}")
        probs = self._normalised(probs)
        shares = np.array([self._share_below(x) for x in edges[1:-1]]).reshape(-1, self.n)  # (inner edges, n)
        below = probs @ shares.T
        cum = np.concatenate([np.zeros((len(probs), 1)), below, np.ones((len(probs), 1))], 1)
        return np.clip(np.diff(cum, axis=1), 0.0, 1.0)

    def _share_below(self, x: float) -> np.ndarray:
        """The fraction of each bucket's mass below ``x``, ``(n,)``."""
        e = np.asarray(self.edges)
        share = np.empty(self.n)
        levels = np.linspace(0.0, 1.0, len(self.within[0]) if self.within else 2)
        for k in range(self.n):
            if x <= e[k]:
                share[k] = 0.0
            elif x >= e[k + 1]:
                share[k] = 1.0
            elif self.within is None:
                share[k] = (x - e[k]) / (e[k + 1] - e[k])
            else:
                table = np.asarray(self.within[k])
                # inverse of the piecewise-linear quantile function; flat stretches are point masses
                share[k] = 0.5 * (
                    np.interp(x, table, levels, left=0.0, right=1.0)
                    + np.interp(-x, -table[::-1], levels[::-1], left=1.0, right=0.0)
                )
        return share

    def _normalised(self, probs: np.ndarray) -> np.ndarray:
        """Checked ``probs`` with rows scaled to sum to one."""
        probs = self._check(probs)
        return probs / probs.sum(1, keepdims=True).clip(min=1e-300)

    def _check(self, probs: np.ndarray) -> np.ndarray:
        """``probs`` as a float64 ``(batch, n)`` array, or a ValueError naming the shape it has."""
        probs = np.asarray(probs, dtype=np.float64)
        if probs.ndim != 2 or probs.shape[1] != self.n:
            raise ValueError(f"probabilities must have shape (batch, {self.n}), not {probs.shape}")
        return probs

    def median(self, probs: np.ndarray) -> np.ndarray:
        """The predictive median of each row of ``probs`` (see :meth:`quantile`)."""
        return self.quantile(probs, 0.5)

    def with_calibration(self, factor: float) -> Buckets:
        return Buckets(self.edges, self.values, self.scheme, float(factor), self.within)

    def to_dict(self) -> dict:
        d = {
            "scheme": self.scheme,
            "edges": list(self.edges),
            "values": list(self.values),
            "calibration": self.calibration,
        }
        if self.within is not None:
            d["within"] = [list(w) for w in self.within]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Buckets:
        try:
            return cls(
                tuple(float(x) for x in d["edges"]),
                tuple(float(x) for x in d["values"]),
                d.get("scheme", "quantile"),
                float(d.get("calibration", 1.0)),
                tuple(tuple(float(x) for x in w) for w in d["within"]) if d.get("within") else None,
            )
        except KeyError as e:
            raise ValueError(f"bucket file lacks field {e.args[0]!r}") from e

    def save(self, path) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2)

    @classmethod
    def load(cls, path) -> Buckets:
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))


def _values(edges: np.ndarray, lengths: np.ndarray) -> tuple[float, ...]:
    """Mean training length per bucket (the midpoint where a bucket got no training answer)."""
    labels = np.searchsorted(edges[1:-1], lengths, side="right")
    mids = (edges[:-1] + edges[1:]) / 2.0
    out = []
    for i in range(len(edges) - 1):
        sel = lengths[labels == i]
        out.append(float(sel.mean()) if sel.size else float(mids[i]))
    return tuple(out)


def _within(edges: np.ndarray, lengths: np.ndarray, m: int = WITHIN_POINTS) -> tuple[tuple[float, ...], ...]:
    """Per bucket, its training lengths at quantile levels ``linspace(0, 1, m)``, clipped to the bucket.

    A length ``l`` counts as the interval ``[l - 0.5, l + 0.5]`` (continuity correction), so a
    bucket of one repeated length still spreads over a token; a bucket without training answers
    is taken as uniform between its edges.
    """
    labels = np.searchsorted(edges[1:-1], lengths, side="right")
    levels = np.linspace(0.0, 1.0, m)
    out = []
    for i in range(len(edges) - 1):
        lo, hi = float(edges[i]), float(edges[i + 1])
        sel = np.sort(lengths[labels == i])
        if sel.size:
            # quantile function of the lengths jittered uniformly over [l - 0.5, l + 0.5]: the CDF is
            # piecewise linear through (u - 0.5, share below u) and (u + 0.5, share up to u)
            u, c = np.unique(sel, return_counts=True)
            cum = np.cumsum(c) / sel.size
            xp = np.stack([np.concatenate([[0.0], cum[:-1]]), cum], 1).reshape(-1)
            fp = np.stack([u - 0.5, u + 0.5], 1).reshape(-1)
            q = np.interp(levels, xp, fp)
        else:
            q = lo + levels * (hi - lo)
        q = np.maximum.accumulate(np.clip(q, lo, hi))
        out.append(tuple(float(x) for x in q))
    return tuple(out)


def uniform_buckets(
    lengths: Sequence[float] | np.ndarray, n: int = 10, l_max: float | None = None
) -> Buckets:
    """MICO's buckets: ``n`` of width ``l_max / n`` (``l_max`` defaults to the largest training length)."""
    if n < 1:
        raise ValueError(f"number of buckets must be at least 1, not {n}")
    arr = _as_lengths(lengths)
    if l_max is None:
        if not arr.size:
            raise ValueError("uniform buckets need l_max or at least one training length")
        l_max = float(arr.max())
    if not l_max > 0:
        raise ValueError(f"l_max must be positive, not {l_max}")
    edges = np.linspace(0.0, float(l_max), n + 1)
    return Buckets(tuple(float(x) for x in edges), _values(edges, arr), "uniform", 1.0, _within(edges, arr))


def split_wide(edges: np.ndarray, max_ratio: float) -> np.ndarray:
    """Split every bucket whose upper/lower edge ratio exceeds ``max_ratio`` into log-spaced pieces.

    Equal-mass edges leave the sparse long tail in one wide bucket (on the mixed workload: every
    answer above ~190 tokens, up to 1,414), so a query known to get a long answer can only be
    placed "somewhere above 190". Bounding each bucket's relative width gives the tail the
    resolution that absolute errors (MAE, token sums) need. Buckets starting at 0 are kept.
    """
    if not max_ratio > 1.0:
        raise ValueError(f"max_ratio must be above 1, not {max_ratio}")
    out = [float(edges[0])]
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        if lo > 0 and hi / lo > max_ratio:
            k = int(np.ceil(np.log(hi / lo) / np.log(max_ratio)))
            inner = np.floor(np.exp(np.linspace(np.log(lo), np.log(hi), k + 1)[1:-1])) + 0.5
            out.extend(float(x) for x in np.unique(inner) if lo < x < hi)
        out.append(float(hi))
    return np.asarray(out)


def quantile_buckets(
    lengths: Sequence[float] | np.ndarray, n: int = 10, max_ratio: float | None = None
) -> Buckets:
    """Edges at the training-length quantiles; tied quantiles merge, so there may be fewer than ``n`` buckets.

    With ``max_ratio``, buckets wider than that ratio are split further (:func:`split_wide`).
    """
    if n < 1:
        raise ValueError(f"number of buckets must be at least 1, not {n}")
    arr = _as_lengths(lengths)
    if not arr.size:
        raise ValueError("quantile buckets need at least one training length")
    inner = np.quantile(arr, np.arange(1, n) / n) if n > 1 else np.array([])
    # A length equal to an edge goes up (side="right"); nudge edges to the half-integer so that
    # integer lengths split as the quantiles intend and edges stay strictly increasing.
    inner = np.unique(np.floor(inner) + 0.5)
    inner = inner[(inner > 0) & (inner < arr.max())]
    top = max(float(arr.max()) + 1.0, float(inner[-1]) + 1.0 if inner.size else 1.0)
    edges = np.concatenate([[0.0], inner, [top]])
    if max_ratio is not None:
        edges = split_wide(edges, max_ratio)
    return Buckets(tuple(float(x) for x in edges), _values(edges, arr), "quantile", 1.0, _within(edges, arr))


def make_buckets(
    lengths: Sequence[float] | np.ndarray,
    scheme: str = "quantile",
    n: int = 10,
    l_max: float | None = None,
    max_ratio: float | None = None,
) -> Buckets:
    """Dispatch on ``scheme`` (``uniform`` or ``quantile``; ``max_ratio`` applies to ``quantile``)."""
    if scheme == "uniform":
        return uniform_buckets(lengths, n, l_max)
    if scheme == "quantile":
        return quantile_buckets(lengths, n, max_ratio)
    raise ValueError(f"unknown bucket scheme {scheme!r}; choose one of {', '.join(SCHEMES)}")
