"""Model version directories on disk, read without torch: where a version is, what it holds, and the
in-memory :class:`LoadedModel` (:mod:`predictor.store` loads and writes the torch models; the fast
serving path, :mod:`predictor.fastpath`, reads a version through this module alone).

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
from typing import TYPE_CHECKING

import numpy as np

from predictor.buckets import Buckets
from predictor.choice import SHIPPED as SHIPPED_NAME
from predictor.choice import SHIPPED_DIR, is_shipped

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

BUCKETS_FILE = "buckets.json"
META_FILE = "predictor.json"
METRICS_FILE = "metrics.json"
LATEST_FILE = "latest"
_VERSION_RE = re.compile(r"^v(\d+)$")


@dataclass
class LoadedModel:
    """A model version in memory: one classifier with its tokenizer, or an ensemble of such members.
    ``model`` is None for an ensemble, and for a member read for the fast path alone
    (:func:`predictor.fastpath.load_dir`: its tokenizer, no weights)."""

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
        from predictor.inference import predict_proba  # torch: only a model with weights predicts here

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


def read_meta(vdir: Path) -> dict:
    """``predictor.json`` of the version directory ``vdir`` (``version`` defaults to its name)."""
    meta_path = vdir / META_FILE
    meta = json.loads(meta_path.read_text(encoding="utf-8")) if meta_path.is_file() else {}
    meta.setdefault("version", vdir.name)
    return meta


def check_members(vdir: Path) -> list[str]:
    """The members of the ensemble ``vdir``, each a single model directory (else ValueError)."""
    names = member_names(vdir)
    missing = [n for n in names if not is_version_dir(vdir / n) or member_names(vdir / n)]
    if missing:
        raise ValueError(f"{vdir}: members {', '.join(missing)} are not single model directories")
    return names


def ensemble(vdir: Path, meta: dict, members: tuple[LoadedModel, ...]) -> LoadedModel:
    """The ensemble ``vdir`` of loaded ``members``, which must share its bucket edges."""
    buckets = Buckets.load(vdir / BUCKETS_FILE)
    for m in members:
        if m.buckets.edges != buckets.edges:
            raise ValueError(f"{vdir}: member {m.path.name} has other bucket edges than the ensemble")
    return LoadedModel(None, None, buckets, meta, vdir, members)


def describe(loaded: LoadedModel) -> str:
    """One line for the gateway log: ``learned (shipped-v1-12af268c, test tau 0.71, MAE 25.1 tokens, ...)``."""
    shipped = loaded.meta.get("shipped") or {}
    test = shipped.get("test") or {}
    parts = [loaded.version]
    if "kendall_tau" in test:
        parts.append(f"test tau {test['kendall_tau']:.3f}, MAE {test['mae_tokens']:.1f} tokens")
    if shipped.get("serving_tokenizer"):
        parts.append(f"lengths in {shipped['serving_tokenizer'].get('name')} tokens")
    where = "shipped with the project" if is_shipped(loaded.path) else str(loaded.path)
    return f"learned ({', '.join(parts)}; {where})"


def read_metrics(path: str | os.PathLike) -> dict:
    p = resolve(path) / METRICS_FILE
    return json.loads(p.read_text(encoding="utf-8")) if p.is_file() else {}


def write_metrics(path: str | os.PathLike, metrics: dict) -> None:
    (resolve(path) / METRICS_FILE).write_text(json.dumps(metrics, indent=2), encoding="utf-8")
