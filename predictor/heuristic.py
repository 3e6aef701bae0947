"""The length estimate without a model: numpy only, so a gateway serving it imports no torch, transformers
or scikit-learn (:mod:`predictor.serving`)."""

from __future__ import annotations

import numpy as np


def prompt_length_heuristic(prompt_words: np.ndarray) -> np.ndarray:
    """The fallback without a model: ``clip(64 + prompt_words, 16, 512)`` tokens (see serving)."""
    return np.clip(64.0 + np.asarray(prompt_words, dtype=np.float64), 16.0, 512.0)
