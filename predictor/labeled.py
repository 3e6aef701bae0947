"""Labelled examples (prompt, response length in serving tokens, source) and deterministic splits.

A split is a function of the prompt text alone (a hash), so the same prompt always lands in
the same split whatever the order, subsample or source it comes from, and duplicates never
leak from train into test.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fleetdata.datasets import Record, load_dataset, load_jsonl, response_lengths

log = logging.getLogger(__name__)

SPLITS = ("train", "val", "test")


@dataclass(frozen=True)
class LabeledSet:
    """Parallel lists of prompts, true response lengths (tokens) and source names."""

    prompts: list[str]
    lengths: np.ndarray
    sources: list[str]

    def __post_init__(self) -> None:
        if not (len(self.prompts) == len(self.lengths) == len(self.sources)):
            raise ValueError("prompts, lengths and sources must have the same length")

    def __len__(self) -> int:
        return len(self.prompts)

    def subset(self, idx: Sequence[int] | np.ndarray) -> LabeledSet:
        idx = np.asarray(idx, dtype=np.int64)
        return LabeledSet([self.prompts[i] for i in idx], self.lengths[idx], [self.sources[i] for i in idx])

    def concat(self, other: LabeledSet) -> LabeledSet:
        return LabeledSet(
            self.prompts + other.prompts,
            np.concatenate([self.lengths, other.lengths]),
            self.sources + other.sources,
        )

    def sample(self, n: int | None, seed: int = 0) -> LabeledSet:
        """A deterministic random subsample of at most ``n`` examples (all when ``n`` is None)."""
        if n is None or n >= len(self):
            return self
        idx = np.sort(np.random.default_rng(seed).choice(len(self), size=n, replace=False))
        return self.subset(idx)


def split_of(prompt: str, fractions: tuple[float, float] = (0.8, 0.1)) -> str:
    """``train``/``val``/``test`` from a hash of the prompt (``fractions`` = train, val; test gets the rest)."""
    h = int.from_bytes(hashlib.sha1(prompt.encode("utf-8", "replace")).digest()[:8], "big") / 2**64
    if h < fractions[0]:
        return "train"
    if h < fractions[0] + fractions[1]:
        return "val"
    return "test"


def split(data: LabeledSet, fractions: tuple[float, float] = (0.8, 0.1)) -> dict[str, LabeledSet]:
    """Deterministic train/val/test split by prompt hash."""
    if not (0 < fractions[0] < 1 and 0 <= fractions[1] < 1 and sum(fractions) < 1):
        raise ValueError(f"split fractions must be in (0, 1) and sum below 1, not {fractions}")
    names = [split_of(p, fractions) for p in data.prompts]
    return {s: data.subset([i for i, n in enumerate(names) if n == s]) for s in SPLITS}


def records_for(name: str, data_dir: str | os.PathLike | None = None) -> list[Record]:
    """Records of a dataset name (``mixed``, a source, ``alpaca_eval:<model>``) or of a ``.jsonl`` path."""
    if name.endswith(".jsonl") or Path(name).is_file():
        if not Path(name).is_file():
            raise FileNotFoundError(f"JSONL file {name} not found")
        return load_jsonl(name)
    return load_dataset(name, Path(data_dir) if data_dir else None)


def label(records: Sequence[Record], tokenizer=None) -> LabeledSet:
    """Turn records into a :class:`LabeledSet` (lengths in ``tokenizer`` tokens; the serving tokenizer by default)."""
    if tokenizer is None and any(r.length is None or r.response for r in records):
        # here, not at the top: localmodels loads torch and transformers, and this module (the
        # splits, read by load/) needs neither otherwise
        from localmodels import default_tokenizer

        tokenizer = default_tokenizer()
    lengths = np.asarray(response_lengths(records, tokenizer), dtype=np.int64)
    return LabeledSet([r.prompt for r in records], lengths, [r.source for r in records])


def load_labeled(
    name: str,
    data_dir: str | os.PathLike | None = None,
    tokenizer=None,
    limit: int | None = None,
    seed: int = 0,
) -> LabeledSet:
    """Load, label and optionally subsample (``limit``) a dataset."""
    records = records_for(name, data_dir)
    if not records:
        raise ValueError(f"dataset {name!r} has no records")
    data = label(records, tokenizer)
    log.info("loaded %d examples from %s", len(data), name)
    return data.sample(limit, seed)
