"""Model directories and their versions.

A *version directory* holds a Hugging Face model + tokenizer, ``buckets.json`` (edges,
representative values, calibration), ``predictor.json`` (max_len, version, how it was
trained) and ``metrics.json``. A *parent directory* holds ``v1/``, ``v2/``, ... and a
``latest`` file naming the current one; it is written last and atomically, so readers
never see a half-written version.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer

from predictor.buckets import Buckets
from predictor.model import load_classifier

log = logging.getLogger(__name__)

BUCKETS_FILE = "buckets.json"
META_FILE = "predictor.json"
METRICS_FILE = "metrics.json"
LATEST_FILE = "latest"
_VERSION_RE = re.compile(r"^v(\d+)$")
#: The model shipped with the project (package data); ``shipped`` names it wherever a model directory is asked for.
SHIPPED_DIR = Path(__file__).resolve().parent / "shipped_model"
SHIPPED_NAME = "shipped"


@dataclass
class LoadedModel:
    model: torch.nn.Module  # DistilBertForSequenceClassification, or model.MeanPoolClassifier
    tokenizer: object
    buckets: Buckets
    meta: dict
    path: Path

    @property
    def version(self) -> str:
        return str(self.meta.get("version", self.path.name))

    @property
    def max_len(self) -> int:
        return int(self.meta.get("max_len", 128))

    @property
    def truncation(self) -> str:
        return str(self.meta.get("truncation", "head"))

    @property
    def point_estimate(self) -> str:
        """``expected``, ``median`` or ``midpoint``: chosen on validation data at training time
        (models saved without the field declare ``expected``)."""
        return str(self.meta.get("point_estimate", "expected"))


def is_version_dir(path: str | os.PathLike) -> bool:
    p = Path(path)
    return (p / BUCKETS_FILE).is_file() and (p / "config.json").is_file()


def versions(parent: str | os.PathLike) -> list[int]:
    """Version numbers present under ``parent`` (complete ones only), ascending."""
    p = Path(parent)
    if not p.is_dir():
        return []
    out = []
    for child in p.iterdir():
        m = _VERSION_RE.match(child.name)
        if m and is_version_dir(child):
            out.append(int(m.group(1)))
    return sorted(out)


def resolve(path: str | os.PathLike) -> Path:
    """A version directory itself, or the one a parent's ``latest`` names (else its highest ``v<N>``);
    ``shipped``: the model shipped with the project."""
    p = SHIPPED_DIR if str(path) == SHIPPED_NAME else Path(path)
    if is_version_dir(p):
        return p
    latest = p / LATEST_FILE
    if latest.is_file():
        name = latest.read_text(encoding="utf-8").strip()
        if is_version_dir(p / name):
            return p / name
        log.warning(
            "%s names %r, which is not a complete model version; using the highest version", latest, name
        )
    vs = versions(p)
    if not vs:
        raise FileNotFoundError(f"{p} is neither a predictor model directory nor a parent of versions v<N>/")
    return p / f"v{vs[-1]}"


def next_version_dir(parent: str | os.PathLike) -> Path:
    """``parent/v<N+1>`` (not yet created); counts incomplete version folders too, so none is overwritten."""
    p = Path(parent)
    taken = [int(m.group(1)) for c in (p.iterdir() if p.is_dir() else []) if (m := _VERSION_RE.match(c.name))]
    return p / f"v{max(taken, default=0) + 1}"


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
    meta = {**meta, "version": vdir.name}
    model.save_pretrained(str(vdir))
    tokenizer.save_pretrained(str(vdir))
    (vdir / META_FILE).write_text(json.dumps(meta, indent=2), encoding="utf-8")
    (vdir / METRICS_FILE).write_text(json.dumps(metrics or {}, indent=2), encoding="utf-8")
    buckets.save(vdir / BUCKETS_FILE)  # written last: its presence marks the version complete
    tmp = parent / f".{LATEST_FILE}.tmp"
    tmp.write_text(vdir.name + "\n", encoding="utf-8")
    os.replace(tmp, parent / LATEST_FILE)
    log.info("saved predictor model %s", vdir)
    return vdir


def load(path: str | os.PathLike, device: str | torch.device = "cpu") -> LoadedModel:
    """Load a version directory (or a parent's latest version)."""
    vdir = resolve(path)
    meta_path = vdir / META_FILE
    meta = json.loads(meta_path.read_text(encoding="utf-8")) if meta_path.is_file() else {}
    meta.setdefault("version", vdir.name)
    tok = AutoTokenizer.from_pretrained(str(vdir), local_files_only=True)
    model = load_classifier(vdir)
    model.to(device).eval()
    buckets = Buckets.load(vdir / BUCKETS_FILE)
    if model.config.num_labels != buckets.n:
        raise ValueError(f"{vdir}: model has {model.config.num_labels} outputs but {buckets.n} buckets")
    return LoadedModel(model, tok, buckets, meta, vdir)


def read_metrics(path: str | os.PathLike) -> dict:
    p = resolve(path) / METRICS_FILE
    return json.loads(p.read_text(encoding="utf-8")) if p.is_file() else {}


def write_metrics(path: str | os.PathLike, metrics: dict) -> None:
    (resolve(path) / METRICS_FILE).write_text(json.dumps(metrics, indent=2), encoding="utf-8")
