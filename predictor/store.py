"""Model directories and their versions.

A *version directory* holds a Hugging Face model + tokenizer, ``buckets.json`` (edges,
representative values, calibration), ``predictor.json`` (max_len, version, how it was
trained) and ``metrics.json``. A *parent directory* holds ``v1/``, ``v2/``, ... and a
``latest`` file naming the current one; it is written last and atomically, so readers
never see a half-written version.

An *ensemble* version directory holds no model of its own: its ``predictor.json`` lists
``members``, sub-directories that are each a complete version directory with the same bucket
edges, and it predicts the mean of their bucket probabilities; its ``buckets.json`` carries the
calibration and its ``predictor.json`` the point estimate fit for that mean.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import AutoTokenizer

from predictor.buckets import Buckets
from predictor.choice import SHIPPED as SHIPPED_NAME
from predictor.choice import SHIPPED_DIR
from predictor.inference import predict_proba
from predictor.model import load_classifier

log = logging.getLogger(__name__)

BUCKETS_FILE = "buckets.json"
META_FILE = "predictor.json"
METRICS_FILE = "metrics.json"
LATEST_FILE = "latest"
_VERSION_RE = re.compile(r"^v(\d+)$")


@dataclass
class LoadedModel:
    """A model version in memory: one classifier with its tokenizer, or an ensemble of such members."""

    # DistilBertForSequenceClassification or model.MeanPoolClassifier; None for an ensemble
    model: torch.nn.Module | None
    tokenizer: object | None  # None for an ensemble (each member has its own)
    buckets: Buckets
    meta: dict
    path: Path
    members: tuple[LoadedModel, ...] = ()  # an ensemble's members (empty for one model)

    @property
    def parts(self) -> tuple[LoadedModel, ...]:
        """The single models whose probabilities this one averages: its members, or itself."""
        return self.members or (self,)

    def predict_proba(
        self, prompts: Sequence[str], batch_size: int = 64, progress: bool = False
    ) -> np.ndarray:
        """Bucket probabilities ``(len(prompts), n_buckets)``: the mean of the members' for an ensemble."""
        return np.mean(
            [
                predict_proba(m.model, m.tokenizer, prompts, m.max_len, batch_size, progress, m.truncation)
                for m in self.parts
            ],
            axis=0,
        )

    @property
    def version(self) -> str:
        return str(self.meta.get("version", self.path.name))

    @property
    def max_len(self) -> int:
        self._single("max_len")
        return int(self.meta.get("max_len", 128))

    def _single(self, what: str) -> None:
        if self.members:
            raise ValueError(f"{self.path} is an ensemble: each member has its own {what}")

    @property
    def truncation(self) -> str:
        self._single("truncation")
        return str(self.meta.get("truncation", "head"))

    @property
    def point_estimate(self) -> str:
        """``expected``, ``median`` or ``midpoint``: chosen on validation data at training time
        (models saved without the field declare ``expected``)."""
        return str(self.meta.get("point_estimate", "expected"))


def check_same_edges(members: Sequence[LoadedModel], option: str) -> None:
    """Models whose probabilities are averaged must share the first one's bucket edges."""
    for m in members[1:]:
        if m.buckets.edges != members[0].buckets.edges:
            raise ValueError(f"{option}: {m.path} has other bucket edges than {members[0].path}")


def member_names(path: str | os.PathLike) -> list[str]:
    """The member sub-directories an ensemble version directory lists (empty for one model)."""
    meta = Path(path) / META_FILE
    if not meta.is_file():
        return []
    try:
        names = json.loads(meta.read_text(encoding="utf-8")).get("members") or []
    except (ValueError, AttributeError) as e:
        raise ValueError(f"{meta} is not a JSON object: {e}") from e
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"{meta}: members must be a list of sub-directory names")
    for name in names:
        if not name or Path(name).name != name or name in (".", ".."):
            raise ValueError(f"{meta}: member {name!r} is not a sub-directory name")
    if len(set(names)) != len(names):
        raise ValueError(f"{meta}: a member is listed twice")
    return names


def is_version_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` holds a complete model version (one model, or an ensemble listing members)."""
    p = Path(path)
    if not (p / BUCKETS_FILE).is_file():
        return False
    if (p / "config.json").is_file():
        return True
    try:
        return bool(member_names(p))
    except ValueError:
        return False  # load() names the problem


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
    if (p / BUCKETS_FILE).is_file() and (p / META_FILE).is_file():
        member_names(p)  # a version whose ensemble record is broken: say what is wrong with it
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
    meta_path = vdir / META_FILE
    meta = json.loads(meta_path.read_text(encoding="utf-8")) if meta_path.is_file() else {}
    meta.setdefault("version", vdir.name)
    if meta.get("members"):
        names = member_names(vdir)
        missing = [n for n in names if not is_version_dir(vdir / n) or member_names(vdir / n)]
        if missing:
            raise ValueError(f"{vdir}: members {', '.join(missing)} are not single model directories")
        members = tuple(load(vdir / name, device) for name in names)
        buckets = Buckets.load(vdir / BUCKETS_FILE)
        for m in members:
            if m.buckets.edges != buckets.edges:
                raise ValueError(f"{vdir}: member {m.path.name} has other bucket edges than the ensemble")
        return LoadedModel(None, None, buckets, meta, vdir, members)
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
