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

if TYPE_CHECKING:  # torch and the model code load only for the torch path: a gateway starts light
    from predictor import fastpath, versions

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
        loaded: versions.LoadedModel | None,
        source: Path | None = None,
        max_batch: int = 512,
        fast: bool = True,
        fast_model: fastpath.FastModel | None = None,
        threads: int = 0,
    ) -> None:
        """``fast``: serve through the version's fast path (:mod:`predictor.fastpath`) where it has one;
        False: always the torch members. ``fast_model``: that path, loaded already (with ``loaded`` read
        for it alone, :func:`predictor.fastpath.load_dir`, on ``threads`` threads, 0: the runtime's default)."""
        self._source = source
        self._loaded = loaded
        self._use_fast = fast
        self._threads = threads
        if fast_model is None and fast and loaded is not None:
            fast_model = _fast_path(loaded)
        self._fast = fast_model if fast else None
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
        source = Path(path)
        from predictor import fastpath, versions

        light = fastpath.load_dir(source, threads)  # the fast path alone: no torch weights, no model code
        if light is not None:
            predictor = cls(light[0], source, fast_model=light[1], threads=threads)
        else:
            predictor = cls._load_torch(source, threads)
            if predictor is None:
                return cls(None, None)
        assert predictor._loaded is not None
        log.info(
            "length predictor: %s, served by %s", versions.describe(predictor._loaded), predictor.backend
        )
        return predictor

    @classmethod
    def _load_torch(cls, source: Path, threads: int) -> LengthPredictor | None:
        """The torch members of ``source`` (and their fast path, where it loads); None: the shipped model
        failed to load (logged; the heuristic serves). Any other directory that fails to load raises."""
        if threads > 0:  # before the load: the fast path's sessions take torch's thread count
            import torch

            torch.set_num_threads(threads)
        from predictor import store

        try:
            loaded = store.load(source)
        except Exception as e:
            if not choice.is_shipped(source):
                raise
            log.error("the shipped length predictor %s failed to load (%s); using the heuristic", source, e)
            return None
        return cls(loaded, source, threads=threads)

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
        with self._run_lock:
            if fast is not None:
                probs = fast.predict_proba(prompts, self._max_batch)
            else:
                import torch

                with torch.inference_mode():
                    probs = loaded.predict_proba(prompts, self._max_batch)
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
        from predictor import fastpath

        light = fastpath.load_dir(source, self._threads) if self._use_fast else None
        if light is not None:
            loaded, fast = light
        else:
            from predictor import store

            loaded = store.load(source)
            fast = _fast_path(loaded) if self._use_fast else None
        with self._state_lock:
            old = self.version
            self._loaded, self._fast, self._source = loaded, fast, source
        if loaded.version != old:
            log.info("predictor reloaded: %s -> %s (%s)", old, loaded.version, loaded.path)
        return loaded.version


def _fast_path(loaded: versions.LoadedModel) -> fastpath.FastModel | None:
    from predictor import fastpath

    return fastpath.load(loaded)


def load_shipped(path: str | os.PathLike | None = None) -> LengthPredictor:
    """The model shipped with the project (:mod:`predictor.shipped`; ``path``: another copy of it) as a
    :class:`LengthPredictor`."""
    return LengthPredictor.from_dir(choice.SHIPPED_DIR if path is None else path)
