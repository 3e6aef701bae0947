"""Several models as one: the mean of their bucket probabilities (``predictor eval --ensemble``) and
a teacher built from them for distillation (``predictor train --teacher``)."""

from __future__ import annotations

import logging

import numpy as np

from predictor import store
from predictor.inference import predict_with_features
from predictor.pipeline import Teacher

log = logging.getLogger("predictor")


def check_same_edges(members: list[store.LoadedModel], option: str) -> None:
    """Models whose probabilities are averaged must share the first one's bucket edges."""
    for m in members[1:]:
        if m.buckets.edges != members[0].buckets.edges:
            raise ValueError(f"{option}: {m.path} has other bucket edges than {members[0].path}")


def _outputs(
    members: list[store.LoadedModel], prompts: list[str], features: bool
) -> list[tuple[np.ndarray, np.ndarray | None]]:
    """Each member's bucket probabilities on ``prompts`` and, with ``features``, its head inputs."""
    return [
        predict_with_features(
            m.model,
            m.tokenizer,
            prompts,
            m.max_len,
            128,
            progress=True,
            truncation=m.truncation,
            features=features,
        )
        for m in members
    ]


def mean_probs(members: list[store.LoadedModel], prompts: list[str]) -> np.ndarray:
    """The mean of the members' bucket probabilities on ``prompts``."""
    return np.mean([p for p, _ in _outputs(members, prompts, False)], axis=0)


def teacher(dirs: list[str], prompts: list[str], device: str, features: bool = False) -> Teacher:
    """The mean probabilities of the models in ``dirs`` (``--teacher``) on the training prompts and,
    with ``features``, their head inputs side by side (``--feature-weight``)."""
    if not dirs:
        raise ValueError("--teacher names no model directory")
    members = [store.load(d, device) for d in dirs]
    check_same_edges(members, "--teacher")
    log.info("distilling from %s on %d training prompts", ", ".join(dirs), len(prompts))
    outs = _outputs(members, prompts, features)
    return Teacher(
        list(members[0].buckets.edges),
        np.mean([p for p, _ in outs], axis=0),
        [str(m.path) for m in members],
        np.concatenate([f for _, f in outs], axis=1) if features else None,
    )
