"""Length buckets: edges, labels, representative token counts, and expected tokens from probabilities.

Two schemes:

* ``uniform`` (MICO): ``N`` buckets of width ``l_max / N``; label ``floor(l / (l_max / N))``,
  lengths at or above ``l_max`` go to the last bucket.
* ``quantile``: edges at the quantiles of the training lengths, so each bucket holds about
  the same number of training answers (ties can merge buckets, so there may be fewer than ``N``).

Each bucket has a midpoint (MICO's point estimate) and a representative value (the mean
training length of the bucket), which the probability-weighted expectation uses.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

SCHEMES = ("uniform", "quantile")


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
        probs = np.asarray(probs, dtype=np.float64)
        if probs.ndim != 2 or probs.shape[1] != self.n:
            raise ValueError(f"probabilities must have shape (batch, {self.n}), not {probs.shape}")
        out = probs @ np.asarray(self.values)
        return out * self.calibration if calibrated else out

    def midpoint(self, buckets: np.ndarray) -> np.ndarray:
        """MICO's estimate: the midpoint of each given bucket."""
        return self.midpoints[np.asarray(buckets, dtype=np.int64)]

    def with_calibration(self, factor: float) -> Buckets:
        return Buckets(self.edges, self.values, self.scheme, float(factor))

    def to_dict(self) -> dict:
        return {
            "scheme": self.scheme,
            "edges": list(self.edges),
            "values": list(self.values),
            "calibration": self.calibration,
        }

    @classmethod
    def from_dict(cls, d: dict) -> Buckets:
        try:
            return cls(
                tuple(float(x) for x in d["edges"]),
                tuple(float(x) for x in d["values"]),
                d.get("scheme", "quantile"),
                float(d.get("calibration", 1.0)),
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
    return Buckets(tuple(float(x) for x in edges), _values(edges, arr), "uniform")


def quantile_buckets(lengths: Sequence[float] | np.ndarray, n: int = 10) -> Buckets:
    """Edges at the training-length quantiles; tied quantiles merge, so there may be fewer than ``n`` buckets."""
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
    return Buckets(tuple(float(x) for x in edges), _values(edges, arr), "quantile")


def make_buckets(
    lengths: Sequence[float] | np.ndarray, scheme: str = "quantile", n: int = 10, l_max: float | None = None
) -> Buckets:
    """Dispatch on ``scheme`` (``uniform`` or ``quantile``)."""
    if scheme == "uniform":
        return uniform_buckets(lengths, n, l_max)
    if scheme == "quantile":
        return quantile_buckets(lengths, n)
    raise ValueError(f"unknown bucket scheme {scheme!r}; choose one of {', '.join(SCHEMES)}")
