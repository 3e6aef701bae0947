"""The gateway's length estimates: the predictor's raw estimate, calibrated to the models the fleet serves.

Each worker registers its cluster's **length model** (the served model's name and version,
``length_model`` in its info hash) and adds every answered query's pair (raw estimate, observed length) to
that model's statistics in Redis (:mod:`workqueue.length_stats`). :class:`LengthCalibrator` reads the
statistics of the models the active clusters serve, pooled when they are several, at most every
:data:`REFRESH_S` seconds, and applies :class:`predictor.calibration.Calibration`. Every gateway replica
reads the same statistics, so they calibrate alike. Rows keep both numbers: their ``predicted_tokens`` is the
calibrated estimate (what assignment, the offloader's sizes and the ETA count) and ``raw_predicted_tokens`` the
raw one (what the observed length is compared with: calibrating calibrated estimates would chase its tail).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis

from predictor.calibration import Calibration
from workqueue import WorkQueue, keys
from workqueue.length_stats import LengthStats

log = logging.getLogger(__name__)

REFRESH_S = 2.0  # how stale the calibration may be (one round trip per refresh)


@dataclass(frozen=True)
class LengthEstimates:
    """What the gateway predicts for a list of prompts: the predictor's raw estimates and the calibrated ones."""

    raw: list[float]
    tokens: list[float]

    @classmethod
    def of(cls, predicted: LengthEstimates | list[float]) -> LengthEstimates:
        """``predicted`` as estimates (a plain list: uncalibrated, its raw and calibrated estimates alike)."""
        return predicted if isinstance(predicted, LengthEstimates) else cls(list(predicted), list(predicted))


class LengthCalibrator:
    """The fleet's current calibration, read from Redis (thread-safe; ``clock`` for tests)."""

    def __init__(
        self, queue: WorkQueue, refresh_s: float = REFRESH_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.queue = queue
        self.refresh_s = refresh_s
        self._clock = clock
        self._lock = threading.Lock()
        self._read_at: float | None = None
        self._current = Calibration.identity()
        self._models: tuple[str, ...] = ()

    def current(self) -> Calibration:
        """The calibration of the active clusters' models, re-read when older than ``refresh_s``."""
        now = self._clock()
        with self._lock:
            if self._read_at is not None and now - self._read_at < self.refresh_s:
                return self._current
        try:
            models, stats = self._read()
        except redis.RedisError as e:  # the submission meets Redis next anyway: keep the last one meanwhile
            log.warning("length calibration not re-read (%s); keeping the last one", e)
            return self._current
        calibration = Calibration.from_stats(stats)
        with self._lock:
            if models != self._models:
                log.info(
                    "length calibration for %s: %s",
                    ", ".join(models) or "no registered model",
                    calibration.describe(),
                )
            self._read_at, self._current, self._models = now, calibration, models
        return calibration

    @property
    def models(self) -> tuple[str, ...]:
        return self._models

    def _read(self) -> tuple[tuple[str, ...], LengthStats]:
        r = self.queue.r
        names = sorted(r.smembers(keys.CLUSTERS))
        pipe = r.pipeline(transaction=False)
        for n in names:
            pipe.hmget(keys.cluster_info(n), "state", "length_model")
        infos = pipe.execute() if names else []
        models = sorted({m for state, m in infos if m and (state or "active") == "active"})
        pipe = r.pipeline(transaction=False)
        for m in models:
            pipe.hgetall(keys.length_stats(m))
        stats = LengthStats()
        for h in pipe.execute() if models else []:
            stats = stats.merged(LengthStats.from_fields(h))
        return tuple(models), stats

    def estimates(self, raw: list[float]) -> LengthEstimates:
        """``raw`` with its calibrated estimates."""
        if not raw:
            return LengthEstimates([], [])
        return LengthEstimates(list(raw), [float(x) for x in self.current().apply(raw)])
