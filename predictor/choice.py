"""Which length predictor a ``--predictor`` value names: the shipped model, the heuristic, or a directory.
A leaf (no torch, no transformers): the gateway decides before it loads anything (:mod:`predictor.serving`)."""

from __future__ import annotations

import os
from pathlib import Path

#: The model shipped with the project (package data); ``shipped`` names it wherever a model directory is asked for.
SHIPPED_DIR = Path(__file__).resolve().parent / "shipped_model"
SHIPPED = "shipped"
HEURISTIC = "heuristic"


def choose(spec: str | os.PathLike | None) -> str | None:
    """The model directory a ``--predictor`` value names: ``None`` or ``shipped`` -> the shipped model,
    ``heuristic`` (or ``none``) -> ``None`` (the prompt-length heuristic), anything else -> itself."""
    if spec is None or str(spec) == SHIPPED:
        return str(SHIPPED_DIR)
    if str(spec).lower() in (HEURISTIC, "none", ""):
        return None
    return str(spec)


def is_shipped(path: str | os.PathLike | None) -> bool:
    return path is not None and Path(path).resolve() == SHIPPED_DIR
