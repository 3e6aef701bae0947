"""Loading and writing model versions with their torch models (where versions live and what they hold:
:mod:`predictor.versions`, read without torch; its names are known from here too)."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import AutoTokenizer

from predictor.buckets import Buckets
from predictor.choice import SHIPPED as SHIPPED_NAME  # noqa: F401  (known from here too)
from predictor.choice import SHIPPED_DIR  # noqa: F401  (known from here too)
from predictor.model import load_classifier
from predictor.versions import (  # noqa: F401  (known from here too)
    BUCKETS_FILE,
    LATEST_FILE,
    META_FILE,
    METRICS_FILE,
    LoadedModel,
    check_members,
    check_same_edges,
    ensemble,
    is_version_dir,
    member_names,
    next_version_dir,
    read_meta,
    read_metrics,
    resolve,
    versions,
    write_metrics,
)

log = logging.getLogger(__name__)


def write_version(
    vdir: Path,
    model: torch.nn.Module | None,
    tokenizer: object | None,
    buckets: Buckets,
    meta: dict,
    metrics: dict | None = None,
) -> None:
    """Write one model's files into ``vdir`` (``model`` None: all but the weights and tokenizer, for an
    ensemble's own files or weights written apart, as ``predictor.shipped`` writes fp16 copies)."""
    vdir.mkdir(parents=True, exist_ok=True)
    if model is not None:
        model.save_pretrained(str(vdir))
        tokenizer.save_pretrained(str(vdir))
    (vdir / META_FILE).write_text(json.dumps(meta, indent=2), encoding="utf-8")
    (vdir / METRICS_FILE).write_text(json.dumps(metrics or {}, indent=2), encoding="utf-8")
    buckets.save(vdir / BUCKETS_FILE)  # written last: its presence marks the version complete


def _publish(parent: Path, vdir: Path) -> Path:
    """Point ``parent``'s ``latest`` at the complete version ``vdir`` (atomically)."""
    tmp = parent / f".{LATEST_FILE}.tmp"
    tmp.write_text(vdir.name + "\n", encoding="utf-8")
    os.replace(tmp, parent / LATEST_FILE)
    log.info("saved predictor model %s", vdir)
    return vdir


def save(
    out_parent: str | os.PathLike,
    model,
    tokenizer,
    buckets: Buckets,
    meta: dict,
    metrics: dict | None = None,
) -> Path:
    """Write a new version under ``out_parent`` and point ``latest`` at it; returns the version directory."""
    parent = Path(out_parent)
    parent.mkdir(parents=True, exist_ok=True)
    vdir = next_version_dir(parent)
    vdir.mkdir()
    write_version(vdir, model, tokenizer, buckets, {**meta, "version": vdir.name}, metrics)
    return _publish(parent, vdir)


def save_ensemble(
    out_parent: str | os.PathLike,
    members: Sequence[LoadedModel],
    buckets: Buckets,
    meta: dict,
    metrics: dict | None = None,
    member_metrics: Sequence[dict] | None = None,
) -> Path:
    """Write a new ensemble version under ``out_parent`` (each member as ``m1/``, ``m2/``, ... with its
    own files; ``member_metrics`` their ``metrics.json``, by default copied from where they were
    loaded) and point ``latest`` at it; returns the version directory."""
    if len(members) < 2:
        raise ValueError("an ensemble needs at least two members")
    parent = Path(out_parent)
    parent.mkdir(parents=True, exist_ok=True)
    vdir = next_version_dir(parent)
    vdir.mkdir()
    names = [f"m{i}" for i in range(1, len(members) + 1)]
    if member_metrics is None:
        member_metrics = [read_metrics(m.path) if is_version_dir(m.path) else {} for m in members]
    for name, m, m_metrics in zip(names, members, member_metrics, strict=True):
        write_version(vdir / name, m.model, m.tokenizer, m.buckets, m.meta, m_metrics)
    write_version(vdir, None, None, buckets, {**meta, "members": names, "version": vdir.name}, metrics)
    return _publish(parent, vdir)


def load(path: str | os.PathLike, device: str | torch.device = "cpu") -> LoadedModel:
    """Load a version directory (or a parent's latest version)."""
    vdir = resolve(path)
    meta = read_meta(vdir)
    if meta.get("members"):
        members = tuple(load(vdir / name, device) for name in check_members(vdir))
        return ensemble(vdir, meta, members)
    tok = AutoTokenizer.from_pretrained(str(vdir), local_files_only=True)
    model = load_classifier(vdir)
    model.to(device).eval()
    buckets = Buckets.load(vdir / BUCKETS_FILE)
    if model.config.num_labels != buckets.n:
        raise ValueError(f"{vdir}: model has {model.config.num_labels} outputs but {buckets.n} buckets")
    return LoadedModel(model, tok, buckets, meta, vdir)
