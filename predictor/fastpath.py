"""The fast serving path: a model version's members as ONNX Runtime sessions.

A version directory with a ``fast.json`` (written by ``python -m predictor.fast_build``) holds, beside
each member's Hugging Face files, an ONNX graph of that member (:mod:`predictor.onnx_export`: the
same logits, the last layer cut to the ``[CLS]`` row; fp32 or dynamic int8, whichever recipe the
build's validation rule chose). :class:`FastModel` runs them: each member reads its prompts with its own
tokenizer, as :func:`predictor.inference.predict_proba` does, but length-sorted into chunks of
``chunk`` prompts (16: less padding than one batch of 64), and the bucket probabilities are the mean of
the members', as for the torch ensemble. :class:`predictor.serving.LengthPredictor` serves through
it when the files are there and ``onnxruntime`` imports; otherwise (and for training, ``adapt``,
``eval``) the torch members serve. :func:`load_dir` reads a version for the fast path alone (its
tokenizers, buckets and ONNX graphs: no torch, no model code), as a gateway starts.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from predictor import versions
from predictor.buckets import Buckets
from predictor.encoding import encode

if TYPE_CHECKING:
    import onnxruntime

log = logging.getLogger(__name__)

FAST_FILE = "fast.json"
DEFAULT_CHUNK = 16


def runtime_available() -> bool:
    """Whether ``onnxruntime`` imports (a dependency; a missing one leaves the torch path serving)."""
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        return False
    return True


def read_recipe(path: str | os.PathLike) -> dict | None:
    """The ``fast.json`` record of the version directory ``path`` (None where there is none)."""
    p = Path(path) / FAST_FILE
    if not p.is_file():
        return None
    recipe = json.loads(p.read_text(encoding="utf-8"))
    if not isinstance(recipe, dict) or not isinstance(recipe.get("file"), str):
        raise ValueError(f"{p}: not a fast-path record (no 'file')")
    return recipe


def session(file: str | os.PathLike, threads: int) -> onnxruntime.InferenceSession:
    """An ONNX Runtime CPU session on ``file`` with all graph optimisations and ``threads`` intra-op threads
    (0: ONNX Runtime's default, one a physical core, as torch's default)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = max(0, threads)
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")  # no busy-waiting on shared cores
    return ort.InferenceSession(str(file), so, providers=["CPUExecutionProvider"])


def _softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z -= z.max(axis=1, keepdims=True)
    np.exp(z, out=z)
    return z / z.sum(axis=1, keepdims=True)


class OrtMember:
    """One single model of a version as an ONNX Runtime session, with the torch member's tokenizer,
    ``max_len`` and truncation."""

    def __init__(self, part: versions.LoadedModel, file: str | os.PathLike, chunk: int, threads: int) -> None:
        if chunk < 1:
            raise ValueError("chunk must be at least 1")
        self.file = Path(file)
        self.tokenizer = part.tokenizer
        self.max_len = part.max_len
        self.truncation = part.truncation
        self.n_buckets = part.buckets.n
        self.chunk = chunk
        self.session = session(self.file, threads)

    def predict_proba(self, prompts: Sequence[str]) -> np.ndarray:
        """Bucket probabilities ``(len(prompts), n_buckets)`` float64."""
        out = np.zeros((len(prompts), self.n_buckets), dtype=np.float64)
        if not prompts:
            return out
        ids = encode(self.tokenizer, prompts, self.max_len, self.truncation)
        order = np.argsort([len(x) for x in ids], kind="stable")
        pad = self.tokenizer.pad_token_id
        for start in range(0, len(ids), self.chunk):
            idx = order[start : start + self.chunk]
            rows = [ids[i] for i in idx]
            width = max(len(x) for x in rows)
            input_ids = np.full((len(rows), width), pad, dtype=np.int64)
            mask = np.zeros((len(rows), width), dtype=np.int64)
            for r, x in enumerate(rows):
                input_ids[r, : len(x)] = x
                mask[r, : len(x)] = 1
            (logits,) = self.session.run(None, {"input_ids": input_ids, "attention_mask": mask})
            out[idx] = _softmax(logits)
        return out


class FastModel:
    """A version's members on ONNX Runtime: the mean of their bucket probabilities."""

    def __init__(self, recipe: dict, members: Sequence[OrtMember]) -> None:
        if not members:
            raise ValueError("a fast model needs at least one member")
        self.recipe = recipe
        self.members = tuple(members)

    @property
    def name(self) -> str:
        return str(self.recipe.get("recipe", "onnxruntime"))

    @classmethod
    def from_files(
        cls,
        loaded: versions.LoadedModel,
        file: str,
        chunk: int = DEFAULT_CHUNK,
        threads: int | None = None,
        recipe: dict | None = None,
    ) -> FastModel:
        """Sessions on ``<part>/<file>`` for each single model of ``loaded`` (its members, or itself)."""
        if threads is None:
            import torch

            threads = torch.get_num_threads()  # the same as the torch path: the process's --threads
        members = [OrtMember(part, part.path / file, chunk, threads) for part in loaded.parts]
        return cls(recipe or {"file": file, "chunk": chunk}, members)

    def predict_proba(self, prompts: Sequence[str], batch_size: int = 64) -> np.ndarray:
        """Bucket probabilities ``(len(prompts), n_buckets)`` (``batch_size`` is the torch path's; the
        members run length-sorted chunks of the recipe's ``chunk``)."""
        prompts = list(prompts)
        return np.mean([m.predict_proba(prompts) for m in self.members], axis=0)


def load(loaded: versions.LoadedModel, threads: int | None = None) -> FastModel | None:
    """The fast path of ``loaded``'s version directory: None where it has no ``fast.json``, or where
    ``onnxruntime`` is missing or the sessions fail to load (logged; the torch path then serves)."""
    try:
        recipe = read_recipe(loaded.path)
    except ValueError as e:
        log.error("%s; serving with torch", e)
        return None
    if recipe is None:
        return None
    if not runtime_available():
        log.warning("%s has a fast path but onnxruntime is not installed: serving with torch", loaded.path)
        return None
    try:
        return FastModel.from_files(
            loaded, recipe["file"], int(recipe.get("chunk", DEFAULT_CHUNK)), threads, recipe
        )
    except Exception as e:  # a broken file must not take the predictor down: torch still serves
        log.error("the fast path of %s failed to load (%s); serving with torch", loaded.path, e)
        return None


#: Tokenizer classes read from ``tokenizer.json`` alone (what ``AutoTokenizer`` builds for them is this class).
_PLAIN_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _light_part(vdir: Path, meta: dict) -> versions.LoadedModel | None:
    """One single model of a version without its weights (None: its tokenizer needs the model's code)."""
    config = vdir / "tokenizer_config.json"
    if not config.is_file() or not (vdir / "tokenizer.json").is_file():
        return None
    if json.loads(config.read_text(encoding="utf-8")).get("tokenizer_class") not in _PLAIN_TOKENIZERS:
        return None
    from transformers import PreTrainedTokenizerFast  # the tokenizer's module alone: no model code

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(vdir), local_files_only=True)
    buckets = Buckets.load(vdir / versions.BUCKETS_FILE)
    labels = len(json.loads((vdir / "config.json").read_text(encoding="utf-8")).get("id2label") or {})
    if labels != buckets.n:
        raise ValueError(f"{vdir}: model has {labels} outputs but {buckets.n} buckets")
    return versions.LoadedModel(None, tokenizer, buckets, meta, vdir)


def load_dir(path: str | os.PathLike, threads: int = 0) -> tuple[versions.LoadedModel, FastModel] | None:
    """The version at ``path`` read for the fast path alone: each member's tokenizer and buckets (no torch
    weights: ``model`` is None) and its ONNX Runtime session on ``threads`` threads (0: the runtime's
    default). None where the version has no fast path, ``onnxruntime`` is missing, a tokenizer needs its
    model's code or anything fails to load: then :mod:`predictor.store` loads the torch members, and
    :func:`load` their fast path (which says what failed)."""
    try:
        vdir = versions.resolve(path)
        recipe = read_recipe(vdir)
        if recipe is None or not runtime_available():
            return None
        meta = versions.read_meta(vdir)
        if meta.get("members"):
            names = versions.check_members(vdir)
            parts = [_light_part(vdir / n, versions.read_meta(vdir / n)) for n in names]
            if any(p is None for p in parts):
                return None
            loaded = versions.ensemble(vdir, meta, tuple(p for p in parts if p is not None))
        else:
            part = _light_part(vdir, meta)
            if part is None:
                return None
            loaded = part
        chunk = int(recipe.get("chunk", DEFAULT_CHUNK))
        return loaded, FastModel.from_files(loaded, recipe["file"], chunk, threads, recipe)
    except Exception as e:  # the torch load that follows raises or logs it as it always did
        log.debug("%s: not read for the fast path alone (%s)", path, e)
        return None
