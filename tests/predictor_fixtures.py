"""Small generated workloads and tiny models for the predictor tests (no dataset text, seconds on a CPU)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from localmodels import generated_corpus, train_tokenizer
from predictor.labeled import LabeledSet
from predictor.model import ModelConfig

TINY = ModelConfig(layers=1, dim=32, heads=2, max_len=32, vocab_size=300, dropout=0.0)
_KINDS = {"brief": 8, "explain": 60, "story": 240}
_FILLER = "the a of data model cluster token value list city river music water price book".split()


def synthetic(n: int = 400, seed: int = 0) -> LabeledSet:
    """Prompts whose first word sets the answer length scale (``brief`` ~8, ``explain`` ~60, ``story`` ~240 tokens)."""
    rng = np.random.default_rng(seed)
    kinds = list(_KINDS)
    prompts, lengths, sources = [], [], []
    for i in range(n):
        kind = kinds[i % len(kinds)]
        words = rng.choice(_FILLER, size=int(rng.integers(3, 12))).tolist()
        prompts.append(f"{kind} {' '.join(words)} {i}")
        lengths.append(max(1, int(_KINDS[kind] * rng.uniform(0.7, 1.3))))
        sources.append(kind)
    return LabeledSet(prompts, np.asarray(lengths), sources)


def write_jsonl(data: LabeledSet, path: str | os.PathLike) -> Path:
    """Write ``{prompt, length, source}`` lines (the generic JSONL format)."""
    path = Path(path)
    with path.open("w", encoding="utf-8") as f:
        for p, n, s in zip(data.prompts, data.lengths, data.sources, strict=True):
            f.write(json.dumps({"prompt": p, "length": int(n), "source": s}) + "\n")
    return path


def save_small_tokenizer(path: str | os.PathLike):
    """A 300-token BPE trained on generated text, saved as a 'serving tokenizer' directory."""
    tok = train_tokenizer(generated_corpus(500), vocab_size=300)
    tok.save_pretrained(str(path))
    return tok
