"""Several models as one: the mean of their bucket probabilities (``fleetbatch predictor eval --ensemble``) and
a teacher built from them for distillation (``fleetbatch predictor train --teacher``)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import numpy as np

from predictor import store
from predictor.inference import predict_with_features
from predictor.pipeline import Teacher

log = logging.getLogger("predictor")


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


def single_models(models: list[store.LoadedModel]) -> list[store.LoadedModel]:
    """``models`` with each ensemble replaced by its members (every single model weighs the same)."""
    return [part for m in models for part in m.parts]


def mean_probs(members: list[store.LoadedModel], prompts: list[str]) -> np.ndarray:
    """The mean of the members' bucket probabilities on ``prompts`` (an ensemble counts as its members)."""
    return np.mean([p for p, _ in _outputs(single_models(members), prompts, False)], axis=0)


def cache_key(member: store.LoadedModel, prompts: list[str], features: bool) -> str:
    """What a member's outputs on ``prompts`` depend on: its weights file (path, size, time), how it
    reads prompts, the prompts themselves, and whether head inputs were kept."""
    weights = member.path / "model.safetensors"
    stat = weights.stat() if weights.exists() else None
    h = hashlib.sha1()
    h.update(
        json.dumps(
            [
                str(member.path.resolve()),
                None if stat is None else [stat.st_size, stat.st_mtime_ns],
                member.max_len,
                member.truncation,
                features,
                len(prompts),
            ]
        ).encode()
    )
    for p in prompts:
        h.update(p.encode("utf-8", "surrogatepass") + b"\0")
    return h.hexdigest()[:20]


def _cached_outputs(
    member: store.LoadedModel, prompts: list[str], features: bool, cache: Path
) -> tuple[np.ndarray, np.ndarray | None]:
    """``_outputs`` of one member, read from ``cache`` when an earlier run on the same prompts wrote it."""
    path = cache / f"teacher-{cache_key(member, prompts, features)}.npz"
    if path.exists():
        with np.load(path) as z:
            log.info("teacher outputs of %s read from %s", member.path, path)
            return z["probs"], (z["features"] if features else None)
    probs, feats = _outputs([member], prompts, features)[0]
    cache.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.npz")  # two runs may write at once
    arrays = {"probs": probs} | ({"features": feats} if features else {})
    np.savez(tmp, **arrays)
    tmp.replace(path)
    log.info("teacher outputs of %s kept in %s", member.path, path)
    return probs, feats


def teacher(
    dirs: list[str], prompts: list[str], device: str, features: bool = False, cache: Path | None = None
) -> Teacher:
    """The mean probabilities of the models in ``dirs`` (``--teacher``) on the training prompts and,
    with ``features``, their head inputs side by side (``--feature-weight``). With ``cache``
    (``--teacher-cache``), each model's outputs are kept there and reused by later runs."""
    if not dirs:
        raise ValueError("--teacher names no model directory")
    members = single_models([store.load(d, device) for d in dirs])
    store.check_same_edges(members, "--teacher")
    log.info("distilling from %s on %d training prompts", ", ".join(dirs), len(prompts))
    if cache is None:
        outs = _outputs(members, prompts, features)
    else:
        outs = [_cached_outputs(m, prompts, features, cache) for m in members]
    return Teacher(
        list(members[0].buckets.edges),
        np.mean([p for p, _ in outs], axis=0),
        [str(m.path) for m in members],
        np.concatenate([f for _, f in outs], axis=1) if features else None,
    )
