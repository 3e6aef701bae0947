"""In-process batched length predictor for the gateway.

One forward pass per :meth:`LengthPredictor.predict` call (chunked above ``max_batch``
prompts; one per member for an ensemble version; on ONNX Runtime where the version has a fast path,
:mod:`predictor.fastpath`, e.g. the shipped model), safe to call from several threads at once (the gateway uses
``asyncio.to_thread``), hot reload of a new model version without a restart, and a
logged prompt-length heuristic when no model is configured.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from predictor import choice
from predictor.heuristic import prompt_length_heuristic

if (
    TYPE_CHECKING
):  # torch, transformers and the model code load only with a model: a heuristic gateway starts light
    from predictor import fastpath, store

log = logging.getLogger(__name__)

FALLBACK_VERSION = "fallback"


@dataclass(frozen=True)
class LengthPrediction:
    expected_tokens: float  # probability-weighted expectation over buckets (calibrated): add these up
    midpoint_tokens: float  # midpoint of the argmax bucket (MICO)
    bucket: int  # argmax bucket (-1 for the heuristic fallback)
    median_tokens: float | None = None  # predictive median (minimises absolute error); None if not computed

    def estimate(self, name: str) -> float:
        """The point estimate ``name`` (``expected``, ``median`` or ``midpoint``) in tokens."""
        if name not in ("expected", "median", "midpoint"):
            raise ValueError(f"unknown point estimate {name!r}")
        value = getattr(self, f"{name}_tokens")
        return self.expected_tokens if value is None else value


class LengthPredictor:
    """Thread-safe batched predictor; one forward pass per predict() call (chunked for huge batches;
    one per member for an ensemble)."""

    def __init__(
        self,
        loaded: store.LoadedModel | None,
        source: Path | None = None,
        max_batch: int = 512,
        fast: bool = True,
    ) -> None:
        """``fast``: serve through the version's fast path (:mod:`predictor.fastpath`) where it has one;
        False: always the torch members."""
        self._source = source
        self._loaded = loaded
        self._use_fast = fast
        self._fast = _fast_path(loaded) if fast and loaded is not None else None
        self._max_batch = max_batch
        self._state_lock = threading.Lock()  # guards _loaded / _source swaps
        self._run_lock = threading.Lock()  # one forward pass at a time: torch already uses all cores
        self._warned = False
        if loaded is None:
            self._warn_fallback()

    @classmethod
    def from_dir(cls, model_dir: str | os.PathLike | None, threads: int = 0) -> LengthPredictor:
        """Load a version directory, or a parent's latest version; ``None`` gives the heuristic fallback.
        ``threads`` (> 0): torch's (and the fast path's) threads for the model; the heuristic imports no torch.

        ``shipped`` names the model shipped with the project and ``heuristic`` the fallback
        (:func:`predictor.choice.choose`). If the shipped model fails to load, the heuristic
        serves and an error is logged; any other directory that fails to load raises.
        """
        if model_dir is None or str(model_dir) == "":
            return cls(None, None)
        path = choice.choose(model_dir)
        if path is None:
            return cls(None, None)
        if threads > 0:  # before the load: the fast path's sessions take torch's thread count
            import torch

            torch.set_num_threads(threads)
        from predictor import shipped, store

        source = Path(path)
        try:
            loaded = store.load(source)
        except Exception as e:
            if not shipped.is_shipped(source):
                raise
            log.error("the shipped length predictor %s failed to load (%s); using the heuristic", source, e)
            return cls(None, None)
        predictor = cls(loaded, source)
        log.info("length predictor: %s, served by %s", shipped.describe(loaded), predictor.backend)
        return predictor

    def _warn_fallback(self) -> None:
        if not self._warned:
            self._warned = True
            log.warning(
                "no predictor model configured: using the prompt-length heuristic "
                "(expected tokens = clip(64 + prompt words, 16, 512)); train one with `fleetbatch predictor train`"
            )

    @property
    def version(self) -> str:
        loaded = self._loaded
        return FALLBACK_VERSION if loaded is None else loaded.version

    @property
    def backend(self) -> str:
        """``onnxruntime:<recipe>`` (the fast path), ``torch``, or ``heuristic``."""
        with self._state_lock:
            loaded, fast = self._loaded, self._fast
        if loaded is None:
            return "heuristic"
        return "torch" if fast is None else f"onnxruntime:{fast.name}"

    @property
    def fast_model(self) -> fastpath.FastModel | None:
        """The ONNX Runtime members serving now (None: torch or the heuristic serves)."""
        with self._state_lock:
            return self._fast

    @property
    def is_fallback(self) -> bool:
        return self._loaded is None

    @property
    def point_estimate(self) -> str:
        """The estimate the model declares for per-query ranking/error (chosen on validation data);
        token *sums* should use ``expected_tokens``, which is calibrated for them."""
        loaded = self._loaded
        return "expected" if loaded is None else loaded.point_estimate

    def predict(self, prompts: list[str]) -> list[LengthPrediction]:
        """Predicted response length of each prompt, in serving-tokenizer tokens."""
        if isinstance(prompts, str):
            raise TypeError("predict() takes a list of prompts, not one string")
        prompts = list(prompts)
        if not prompts:
            return []
        with self._state_lock:
            loaded, fast = self._loaded, self._fast
        if loaded is None:
            words = np.array([len(p.split()) for p in prompts])
            est = prompt_length_heuristic(words)
            return [LengthPrediction(float(e), float(e), -1, float(e)) for e in est]
        import torch

        with self._run_lock, torch.inference_mode():
            runner = loaded if fast is None else fast
            probs = runner.predict_proba(prompts, self._max_batch)
        expected = loaded.buckets.expected(probs)
        buckets = probs.argmax(1)
        midpoint = loaded.buckets.midpoint(buckets)
        median = loaded.buckets.median(probs)
        return [
            LengthPrediction(float(e), float(m), int(b), float(md))
            for e, m, b, md in zip(expected, midpoint, buckets, median, strict=True)
        ]

    def reload(self, model_dir: str | os.PathLike | None = None) -> str:
        """Load ``model_dir`` (or re-read the configured directory, picking up a newer version) and swap it in.

        The new model is loaded before the swap, so predictions keep flowing from the old one
        meanwhile; a failed load leaves the old model in place and raises.
        """
        with self._state_lock:
            source = Path(model_dir) if model_dir is not None else self._source
        if source is None:
            self._warn_fallback()
            return self.version
        from predictor import store

        loaded = store.load(source)
        fast = _fast_path(loaded) if self._use_fast else None
        with self._state_lock:
            old = self.version
            self._loaded, self._fast, self._source = loaded, fast, source
        if loaded.version != old:
            log.info("predictor reloaded: %s -> %s (%s)", old, loaded.version, loaded.path)
        return loaded.version


def _fast_path(loaded: store.LoadedModel) -> fastpath.FastModel | None:
    from predictor import fastpath

    return fastpath.load(loaded)


def load_shipped(path: str | os.PathLike | None = None) -> LengthPredictor:
    """The model shipped with the project (:mod:`predictor.shipped`; ``path``: another copy of it) as a
    :class:`LengthPredictor`."""
    return LengthPredictor.from_dir(choice.SHIPPED_DIR if path is None else path)
