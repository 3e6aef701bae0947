"""Each unfinished batch's ETA: when it will be done, and whether that is past its deadline.

The rule, in one place (:func:`estimate`):

1. A batch's **remaining work** is its predicted tokens not yet finished (queued or running, on any
   cluster: ``left_tokens_per_cluster``) times its **length correction**: the actual tokens of its
   answered rows over their predicted tokens, shrunk toward the fleet's ratio (every cluster's
   finished rows) by :data:`PRIOR_TOKENS` tokens of evidence, which is itself shrunk toward 1.
   A served model whose answers run twice as long as the predictor thinks doubles the remaining
   work as soon as its first rows come back, whatever the predictor was trained on.
2. **Work ahead**: batches run in queue order (:mod:`workqueue.ordering`), and the offloader keeps
   the clusters busy on the earliest work, so the fleet is one pool. A batch's finish is now plus the
   remaining work of every batch at or before its order key, its own included, over the fleet's
   throughput.
3. **Throughput** (:class:`Throughput`): work done per second over the last :data:`RATE_WINDOW_S`,
   counted from the first work seen in that window (so the time before the first step does not read
   as slowness). Work done is the actual tokens (prompt + completion) of answered rows plus the
   tokens the running queries hold in the engines' KV caches (prompt and generated so far): without
   them, a fleet that runs its longest queries first (the token policies do) would look slow until
   those finish. Until a rate is measured, the sum of the live clusters' capacities, converted by
   :func:`total_rate`: a capacity counts *generated* tokens per second (the engines' heartbeats and the
   plans measure decoding), while the work counts prompt + completion tokens, so it is scaled by the
   answered rows' total over completion tokens (1 until a row is answered: an early ETA errs late).
   The tokens in flight are not taken off the work ahead: they may belong to a batch behind the one
   estimated, whose running queries still hold the slots it waits for.

Everything is in one unit, actual tokens (prompt + completion), like the predictions.
:class:`EtaBoard` keeps the latest estimate of every batch; the offloader's tick refreshes it every half second.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from workqueue import BatchInfo

log = logging.getLogger(__name__)

PRIOR_TOKENS = 2000.0  # tokens of evidence the fleet's ratio (or 1) counts as in a batch's correction
RATE_WINDOW_S = 60.0
HISTORY = 1200  # (time, finished actual tokens) samples kept for the status page's chart: 10 min at 0.5 s
MIN_RATE_SPAN_S = 2.0  # the measured rate counts once it spans this long after the first completion


@dataclass(frozen=True)
class Eta:
    finish_at: float  # unix seconds
    remaining_tokens: float  # corrected (actual) tokens left
    correction: float  # actual / predicted tokens applied to its remaining predicted tokens
    progress: float  # predicted tokens of its answered rows over its predicted tokens
    at_risk: bool  # a deadline, and the predicted finish is past it


def correction(actual: float, predicted: float, prior: float, mass: float = PRIOR_TOKENS) -> float:
    """Observed actual/predicted tokens, shrunk toward ``prior`` by ``mass`` tokens of evidence."""
    return (actual + mass * prior) / (predicted + mass)


def total_rate(capacity_tps: float, finished_total: float, finished_completion: float) -> float:
    """A capacity in generated tokens/s as prompt + completion tokens/s: times the answered rows' total over
    completion tokens (unchanged when nothing was answered yet)."""
    if finished_completion <= 0 or finished_total <= finished_completion:
        return capacity_tps
    return capacity_tps * finished_total / finished_completion


class Throughput:
    """The fleet's rate in actual tokens per second, from a running total sampled over time."""

    def __init__(self, window_s: float = RATE_WINDOW_S) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque()

    def observe(self, now: float, total: float) -> None:
        self._samples.append((now, total))
        while len(self._samples) > 2 and now - self._samples[1][0] > self.window_s:
            self._samples.popleft()

    def reset(self) -> None:
        """Forget the history (the fleet went idle: idle time is not slowness)."""
        self._samples.clear()

    def rate(self) -> float | None:
        s = self._samples
        if not s:
            return None
        base = s[0][1]
        first = next((i for i, (_, total) in enumerate(s) if total > base), None)
        if first is None:
            return None
        (t0, v0), (t1, v1) = s[first], s[-1]
        if t1 - t0 < MIN_RATE_SPAN_S or v1 <= v0:
            return None
        return (v1 - v0) / (t1 - t0)


def estimate(
    batches: Iterable[BatchInfo], now: float, rate_tps: float, fleet_ratio: float = 1.0
) -> dict[str, Eta]:
    """The ETA of every unfinished batch (the rule in the module docstring)."""
    rate = max(rate_tps, 1e-9)
    out: dict[str, Eta] = {}
    ahead = 0.0
    for b in sorted((b for b in batches if not b.final), key=lambda b: (b.order_key, b.created_at)):
        k = correction(b.done_actual_tokens, b.done_predicted_tokens, fleet_ratio)
        remaining = sum(b.left_tokens_per_cluster.values()) * k
        ahead += remaining
        finish = now + ahead / rate
        predicted = b.predicted_tokens
        progress = min(1.0, b.done_predicted_tokens / predicted) if predicted > 0 else 0.0
        out[b.batch_id] = Eta(finish, remaining, k, progress, b.deadline > 0 and finish > b.deadline)
    return out


class EtaBoard:
    """The latest ETA of every unfinished batch, refreshed by the offloader's tick (thread-safe)."""

    def __init__(self, window_s: float = RATE_WINDOW_S) -> None:
        self._lock = threading.Lock()
        self._throughput = Throughput(window_s)
        self._etas: dict[str, Eta] = {}
        self._batches: list[BatchInfo] = []
        self._history: deque[tuple[float, float]] = deque(maxlen=HISTORY)
        self.rate_tps = 0.0
        self.fleet_ratio = 1.0
        self.updated_at = 0.0

    def update(
        self, now: float, batches: Sequence[BatchInfo], finished_actual: float, finished_predicted: float,
        capacity_tps: float, in_flight: float = 0.0, finished_completion: float = 0.0,
    ) -> dict[str, Eta]:  # fmt: skip
        """Refresh from the unfinished ``batches``, the clusters' running totals of answered rows' actual
        (prompt + completion) and predicted tokens, their capacity in generated tokens/s (used until the
        throughput is measured, converted by :func:`total_rate` with ``finished_completion``: the answered
        rows' completion tokens) and the tokens their running queries hold."""
        with self._lock:
            if not any(not b.final for b in batches):
                self._throughput.reset()
            self._throughput.observe(now, finished_actual + in_flight)
            self._history.append((now, finished_actual + in_flight))
            measured = self._throughput.rate()
            self.rate_tps = (
                measured if measured else total_rate(capacity_tps, finished_actual, finished_completion)
            )
            self.fleet_ratio = correction(finished_actual, finished_predicted, 1.0)
            self._batches = list(batches)
            before, self._etas = self._etas, estimate(batches, now, self.rate_tps, self.fleet_ratio)
            self.updated_at = now
            etas = dict(self._etas)
        for batch_id, e in etas.items():  # never a silent miss: each batch that turns at risk is logged once
            if e.at_risk and not ((old := before.get(batch_id)) and old.at_risk):
                deadline = next((b.deadline for b in batches if b.batch_id == batch_id), 0.0)
                log.warning("batch %s is at risk: predicted to finish %.0f s after its deadline (ETA %.0f s from now)",
                            batch_id, e.finish_at - deadline, e.finish_at - now)  # fmt: skip
        return etas

    def throughput(self, bucket_s: float = 5.0) -> list[tuple[float, float]]:
        """The fleet's throughput over the kept history: (end of each ``bucket_s`` span, actual tokens/s in it)."""
        with self._lock:
            samples = list(self._history)
        out: list[tuple[float, float]] = []
        start = 0
        for i in range(1, len(samples)):
            (t0, v0), (t1, v1) = samples[start], samples[i]
            if t1 - t0 >= bucket_s:
                out.append(
                    (t1, max(0.0, v1 - v0) / (t1 - t0))
                )  # a total that fell (Redis flushed) counts as 0
                start = i
        return out

    def get(self, batch_id: str) -> Eta | None:
        with self._lock:
            return self._etas.get(batch_id)

    def all(self) -> dict[str, Eta]:
        with self._lock:
            return dict(self._etas)

    def new_batch(self, now: float, predicted_tokens: float, order_key: float) -> float:
        """The predicted finish of a batch of ``predicted_tokens`` about to be created with ``order_key``:
        the work at or before its key, plus its own (at the fleet's length correction)."""
        with self._lock:
            if self.rate_tps <= 0:
                return 0.0
            ahead = sum(e.remaining_tokens for b in self._batches if (e := self._etas.get(b.batch_id))
                        and b.order_key <= order_key)  # fmt: skip
            return now + (ahead + predicted_tokens * self.fleet_ratio) / self.rate_tps
