"""Noisy copies of training prompts for distillation (``fleetbatch predictor train --augment K``).

A student distilled from a teacher learns the teacher's function only where it sees inputs. With
a few thousand prompts per source that is thin, so each training prompt gets ``K`` perturbed
copies (words dropped at random, one short span cut out), which the teacher then labels: the
student is taught on K+1 times as many inputs as there are labelled prompts (TinyBERT's data
augmentation for distillation, with plain word-level noise instead of a masked-LM's
replacements). A copy keeps its original's recorded length as its label; the teacher's
probabilities on the copy itself form the rest of its target. Only training prompts are copied,
so nothing held out leaks in.
"""

from __future__ import annotations

import numpy as np

from predictor.labeled import LabeledSet


def perturb(prompt: str, rng: np.random.Generator, drop: float = 0.1, max_span: int = 5) -> str:
    """``prompt`` with each word dropped with probability ``drop`` and one span of up to
    ``max_span`` words cut out (prompts of fewer than 4 words lose at most one word)."""
    words = prompt.split()
    if len(words) < 4:
        if len(words) > 1 and rng.random() < drop * len(words):
            del words[int(rng.integers(len(words)))]
        return " ".join(words)
    keep = rng.random(len(words)) >= drop
    span = int(rng.integers(1, min(max_span, len(words) // 4) + 1))
    start = int(rng.integers(0, len(words) - span + 1))
    keep[start : start + span] = False
    if not keep.any():
        keep[0] = True
    return " ".join(w for w, k in zip(words, keep, strict=True) if k)


def augment(data: LabeledSet, copies: int, seed: int = 0, drop: float = 0.1) -> LabeledSet:
    """``copies`` perturbed copies of every prompt of ``data``, with their originals' lengths and
    sources (copies equal to their original, as short prompts can give, are left out)."""
    if copies < 0:
        raise ValueError(f"--augment must be 0 or more copies per prompt, not {copies}")
    rng = np.random.default_rng(seed)
    idx: list[int] = []
    prompts: list[str] = []
    for _ in range(copies):
        for i, p in enumerate(data.prompts):
            q = perturb(p, rng, drop)
            if q and q != p:
                idx.append(i)
                prompts.append(q)
    picked = data.subset(np.asarray(idx, dtype=np.int64))
    return LabeledSet(prompts, picked.lengths, picked.sources)
