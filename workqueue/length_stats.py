"""What the workers observed of a served model's answer lengths against the predictor's: one place for its rules.

Each answered query adds its pair (the predictor's own estimate before calibration, ``raw``; the completion
tokens the cluster generated, ``observed``) to the statistics of its cluster's **length model** (the served
model's name and version: :func:`length_model_key`), kept in Redis in one HASH per model
(:func:`workqueue.keys.length_stats`): per range of ``raw`` (:data:`RANGE_EDGES`, tokens) the count
``n:<i>``, the sum of ``raw`` ``p:<i>`` and the sum of ``observed`` ``o:<i>``. A worker's tick adds its
pairs in the same call that records its observed lengths, once however often it is sent
(:data:`workqueue.clusters.OBSERVE`). The gateway reads them (:func:`read_stats`) and
:mod:`predictor.calibration` turns them into a calibration; every gateway replica reads the same.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from workqueue import keys

#: the upper edges of the ranges of the predictor's raw estimate, tokens (a half-octave apart; the last is open)
RANGE_EDGES: tuple[float, ...] = (16, 23, 32, 45, 64, 91, 128, 181, 256, 362, 512, 724, 1024, 1448, 2048)
N_RANGES = len(RANGE_EDGES) + 1


def range_of(raw: float) -> int:
    """The range index of a raw estimate."""
    return bisect.bisect_right(RANGE_EDGES, raw)


@dataclass
class LengthStats:
    """Per range: observations, their summed raw estimates and summed observed lengths."""

    n: list[float] = field(default_factory=lambda: [0.0] * N_RANGES)
    raw: list[float] = field(default_factory=lambda: [0.0] * N_RANGES)
    observed: list[float] = field(default_factory=lambda: [0.0] * N_RANGES)

    @property
    def count(self) -> float:
        return sum(self.n)

    def add(self, raw: float, observed: float) -> None:
        i = range_of(raw)
        self.n[i] += 1
        self.raw[i] += raw
        self.observed[i] += observed

    def merged(self, other: LengthStats) -> LengthStats:
        return LengthStats(
            [a + b for a, b in zip(self.n, other.n, strict=True)],
            [a + b for a, b in zip(self.raw, other.raw, strict=True)],
            [a + b for a, b in zip(self.observed, other.observed, strict=True)],
        )

    def fields(self) -> dict[str, float]:
        """The HASH increments (:func:`increments`) these statistics amount to."""
        out: dict[str, float] = {}
        for i in range(N_RANGES):
            if self.n[i]:
                out[f"n:{i}"], out[f"p:{i}"], out[f"o:{i}"] = self.n[i], self.raw[i], self.observed[i]
        return out

    @classmethod
    def from_fields(cls, h: Mapping[str, str | bytes | float]) -> LengthStats:
        s = cls()
        columns = {"n": s.n, "p": s.raw, "o": s.observed}
        for k, v in h.items():
            name, _, i = (k.decode() if isinstance(k, bytes) else k).partition(":")
            if name in columns and i.isdigit() and int(i) < N_RANGES:
                columns[name][int(i)] = float(v)
        return s


def increments(pairs: Iterable[tuple[float, float]]) -> dict[str, float]:
    """The HASH increments of ``(raw, observed)`` pairs (pairs without a positive raw estimate are left out)."""
    s = LengthStats()
    for raw, observed in pairs:
        if raw > 0 and observed >= 0:
            s.add(float(raw), float(observed))
    return s.fields()


def read_stats(r, model: str) -> LengthStats:
    """The statistics of length model ``model`` (empty when nothing was observed)."""
    return LengthStats.from_fields(r.hgetall(keys.length_stats(model)))


def length_model_key(name: str, files: Iterable[Path] = ()) -> str:
    """A served model's key: its name and, for a local directory, 8 hex digits of a digest of its config and
    tokenizer files (the lengths are counted in its tokenizer: another tokenizer is another model)."""
    if not name or ":" in name:
        raise ValueError(f"bad length model name {name!r}: must be non-empty and contain no ':'")
    h = hashlib.sha1()
    seen = False
    for f in sorted(Path(p) for p in files):
        if f.is_file():
            h.update(f.name.encode() + b"\0" + f.read_bytes())
            seen = True
    return f"{name}@{h.hexdigest()[:8]}" if seen else name


#: the files of a model directory that the key digests (config and tokenizer, not the weights)
MODEL_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "generation_config.json",
)


def directory_key(model_dir: str | Path) -> str:
    """:func:`length_model_key` of a local model directory."""
    d = Path(model_dir)
    return length_model_key(d.resolve().name.replace(":", "-"), [d / f for f in MODEL_FILES])
