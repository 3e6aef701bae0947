"""Each unfinished batch's ETA: when it will be done, and whether that is past its deadline.

The rule, in one place (:func:`estimate`):

1. A batch's **remaining work** is its predicted tokens not yet finished (queued or running, on any
   cluster: ``left_tokens_per_cluster``; rows the background intake has not enqueued yet count at the
   mean of those it has, and a batch none of whose rows landed has no ETA yet) times its **length
   correction**: the actual tokens of its
   answered rows over their predicted tokens, shrunk toward the fleet's ratio (every cluster's
   finished rows) by :data:`PRIOR_TOKENS` tokens of evidence, which is itself shrunk toward 1.
   A served model whose answers run twice as long as the predictor thinks doubles the remaining
   work as soon as its first rows come back, whatever the predictor was trained on.
2. **Work ahead**: batches run in queue order (:mod:`workqueue.ordering`). As one pool, a batch's finish is now plus
   the remaining work of every batch at or before its order key, its own included, over the fleet's throughput.
   But a row runs where it is queued: the offloader moves work only to a nearly idle cluster, so while later work
   keeps the other clusters busy, nothing rescues a batch's rows queued on a slow cluster. So each live cluster is
   a **lane** (:class:`Lane`): the work ahead of a batch there is the remaining work of every batch at or before
   its order key queued there, over the lane's rate (its capacity's share of the fleet's throughput, at the
   prompt share of its own answered rows), but never past the pool's **drain** (all remaining work over the
   fleet's throughput: by then the fast clusters have run out of later work and take its queued rows); then
   half a last wave of its rows (a cluster running ``slots`` queries at once ends with a partial wave, the last
   rows at one query's speed; running rows are not moved). A batch's finish is the latest of its lanes (those
   holding its rows), never before its pool estimate. So the last batch in order, which the offloader balances,
   gets the pool estimate plus its slowest lane's half wave; rows on a cluster that is not live (evacuated)
   count in the pool only.
3. **Throughput** (:class:`Throughput`): work done per second over the last :data:`RATE_WINDOW_S`,
   counted from the first completion seen in that window (so the time before the first rows finish
   does not read as slowness). Work is counted in *generated-token equivalents*: a prompt token
   weighs :data:`gateway.assign.loads.PROMPT_WEIGHT` of a generated one (prefill is batched; a
   generated token costs a step). Counted in plain tokens, the rate would follow the mix: a fleet that runs its longest
   answers first (the token policies do) would look slow then fast. The remaining work is
   converted with the prompt share of the fleet's answered rows. Until a rate is measured, the
   sum of the live clusters' capacities (generated tokens/s: work units as they are).

Everything is in one unit, actual tokens, so the ETA needs no conversion between the predictor's
tokens and the engines' rates. :class:`EtaBoard` keeps the latest estimate of every batch; the
offloader's tick refreshes it every half second.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from gateway.assign.loads import work, work_units
from gateway.status.cost import CostMeter
from workqueue import BatchInfo

log = logging.getLogger(__name__)

PRIOR_TOKENS = 2000.0  # tokens of evidence the fleet's ratio (or 1) counts as in a batch's correction
RATE_WINDOW_S = 60.0
PROMPT_SHARE = 0.5  # the prompt share of the work assumed before any row is answered
HISTORY = 1200  # (time, finished actual tokens) samples kept for the status page's chart: 10 min at 0.5 s
MIN_RATE_SPAN_S = 2.0  # the measured rate counts once it spans this long after the first completion


@dataclass(frozen=True)
class Eta:
    finish_at: float  # unix seconds
    remaining_tokens: float  # corrected (actual) tokens left
    correction: float  # actual / predicted tokens applied to its remaining predicted tokens
    progress: float  # predicted tokens of its answered rows over its predicted tokens
    at_risk: bool  # a deadline, and the predicted finish is past it
    cost_dollars: float = 0.0  # billed to it so far (gateway.status.cost)


def correction(actual: float, predicted: float, prior: float, mass: float = PRIOR_TOKENS) -> float:
    """Observed actual/predicted tokens, shrunk toward ``prior`` by ``mass`` tokens of evidence."""
    return (actual + mass * prior) / (predicted + mass)


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


@dataclass(frozen=True)
class Lane:
    """One live cluster as the ETA sees it: its rate in actual tokens per second (of the mix it answers) and how
    many queries it runs at once (its last heartbeat's ``running``; at least 1)."""

    rate: float
    slots: int = 1


def estimate(
    batches: Iterable[BatchInfo],
    now: float,
    rate: float,
    fleet_ratio: float = 1.0,
    prompt_share: float = PROMPT_SHARE,
    lanes: Mapping[str, Lane] | None = None,
    balanced: bool = True,
) -> dict[str, Eta]:
    """The ETA of every unfinished batch (the rule in the module docstring); ``rate`` in generated-token
    equivalents per second; ``lanes``: the live clusters (None or empty: the fleet as one pool only); ``balanced``:
    the offloader evens the lanes out (False under the cost policy, whose moves do not: no lane ends at the drain)."""
    rate = max(rate, 1e-9) / work_units(prompt_share)  # in actual tokens per second of this mix
    lanes = {c: lane for c, lane in (lanes or {}).items() if lane.rate > 0}
    # each batch, its correction, its remaining (corrected) tokens and its corrected tokens per row
    todo: list[tuple[BatchInfo, float, float, float]] = []
    for b in sorted((b for b in batches if not b.final), key=lambda b: (b.order_key, b.created_at)):
        k = correction(b.done_actual_tokens, b.done_predicted_tokens, fleet_ratio)
        left = sum(b.left_tokens_per_cluster.values())
        landed = b.total - b.intake_left
        if b.intake_left:  # rows not enqueued yet: at the mean of those that were; none yet: no ETA yet
            if landed <= 0 or b.predicted_tokens <= 0:
                continue
            left += b.intake_left * b.predicted_tokens / landed
        todo.append((b, k, left * k, k * b.predicted_tokens / max(landed, 1)))
    # every batch done: the pool, balanced by the offloader (never reached when nothing balances the lanes)
    drain = now + sum(t[2] for t in todo) / rate if balanced else math.inf
    out: dict[str, Eta] = {}
    ahead = 0.0
    ahead_on: dict[str, float] = dict.fromkeys(lanes, 0.0)
    for b, k, remaining, row in todo:
        ahead += remaining
        finish = now + ahead / rate
        slowest = finish
        for c, tokens in b.left_tokens_per_cluster.items():
            if c in lanes:
                ahead_on[c] += tokens * k
                if tokens > 0:  # its rows there: the work ahead there (at most the drain), then half a wave
                    lane = lanes[c]
                    wave = row * max(lane.slots, 1) / 2 / lane.rate
                    slowest = max(slowest, min(now + ahead_on[c] / lane.rate, drain) + wave)
        finish = max(finish, slowest)
        predicted = b.predicted_tokens
        progress = min(1.0, b.done_predicted_tokens / predicted) if predicted > 0 else 0.0
        out[b.batch_id] = Eta(finish, remaining, k, progress, b.deadline > 0 and finish > b.deadline)
    return out


@dataclass(frozen=True)
class ClusterLoad:
    """What the offloader's tick read of one live cluster: its running totals of answered rows' actual tokens (prompt
    + completion) and completion tokens, its capacity (generated tokens/s) and its running queries."""

    finished_total: float
    finished_completion: float
    capacity_tps: float
    running: int = 0


class EtaBoard:
    """The latest ETA of every unfinished batch, refreshed by the offloader's tick (thread-safe)."""

    def __init__(
        self, window_s: float = RATE_WINDOW_S, cost: CostMeter | None = None, balanced: bool = True
    ) -> None:
        #: what the fleet and each batch cost so far (the offloader's tick updates it)
        self.cost = cost or CostMeter()
        #: the offloader evens the clusters' finish out (False under the cost policy: the lanes are the clusters that
        #: hold work, and none ends at the pool's drain)
        self.balanced = balanced
        self._lock = threading.Lock()
        self._throughput = Throughput(window_s)
        self._etas: dict[str, Eta] = {}
        self._batches: list[BatchInfo] = []
        self._history: deque[tuple[float, float]] = deque(maxlen=HISTORY)
        self.rate_tps = 0.0  # actual tokens per second, at the answered rows' prompt share
        self.fleet_ratio = 1.0
        self.prompt_share = PROMPT_SHARE
        self.updated_at = 0.0

    def update(
        self, now: float, batches: Sequence[BatchInfo], finished_actual: float, finished_predicted: float,
        capacity_tps: float, finished_completion: float | None = None, clusters: Mapping[str, ClusterLoad] | None = None,
    ) -> dict[str, Eta]:  # fmt: skip
        """Refresh from the unfinished ``batches``, the clusters' running totals of answered rows' actual tokens
        (prompt + completion), predicted tokens and completion tokens (None: the prompt share is not known), and
        their capacity (generated tokens/s, as heartbeats and plans measure it; used until the throughput is
        measured). ``clusters``: the live clusters (:meth:`lanes`); None: the fleet as one pool."""
        with self._lock:
            if not any(not b.final for b in batches):
                self._throughput.reset()
            completion = finished_actual if finished_completion is None else finished_completion
            if finished_actual > 0 and finished_completion is not None:
                self.prompt_share = max(0.0, min(1.0, 1.0 - finished_completion / finished_actual))
            self._throughput.observe(now, work(finished_actual - completion, completion))
            self._history.append((now, finished_actual))
            measured = self._throughput.rate()
            units = work_units(self.prompt_share)
            rate = measured if measured else capacity_tps  # capacities count generated tokens: work units
            self.rate_tps = rate / units
            self.fleet_ratio = correction(finished_actual, finished_predicted, 1.0)
            self._batches = list(batches)
            lanes = self._lanes(rate, clusters or {})
            etas = estimate(batches, now, rate, self.fleet_ratio, self.prompt_share, lanes, self.balanced)
            etas = {b: replace(e, cost_dollars=self.cost.batch(b) or 0.0) for b, e in etas.items()}
            before, self._etas = self._etas, etas
            self.updated_at = now
            etas = dict(self._etas)
        for batch_id, e in etas.items():  # never a silent miss: each batch that turns at risk is logged once
            if e.at_risk and not ((old := before.get(batch_id)) and old.at_risk):
                deadline = next((b.deadline for b in batches if b.batch_id == batch_id), 0.0)
                log.warning("batch %s is at risk: predicted to finish %.0f s after its deadline (ETA %.0f s from now)",
                            batch_id, e.finish_at - deadline, e.finish_at - now)  # fmt: skip
        return etas

    def _lanes(self, rate: float, clusters: Mapping[str, ClusterLoad]) -> dict[str, Lane]:
        """Each live cluster's rate in actual tokens per second: its capacity's share of the fleet's ``rate`` (work
        units), converted at the prompt share of its own answered rows (the fleet's until it has some)."""
        capacity = sum(c.capacity_tps for c in clusters.values())
        lanes = {}
        for name, c in clusters.items():
            share = rate * c.capacity_tps / capacity if capacity > 0 else 0.0
            prompt_share = (
                1.0 - c.finished_completion / c.finished_total if c.finished_total > 0 else self.prompt_share
            )
            lanes[name] = Lane(share / work_units(prompt_share), max(1, c.running))
        return lanes

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

    def deadlines_in_s(self, now: float) -> dict[str, float]:
        """Seconds from ``now`` to the deadline of each unfinished batch of the last update that has one."""
        with self._lock:
            return {b.batch_id: b.deadline - now for b in self._batches if not b.final and b.deadline > 0}

    def get(self, batch_id: str) -> Eta | None:
        with self._lock:
            return self._etas.get(batch_id)

    def all(self) -> dict[str, Eta]:
        with self._lock:
            return dict(self._etas)

    def put(self, batch_id: str, eta: Eta) -> None:
        """A new batch's ETA, as its submission estimated it, until the next refresh."""
        with self._lock:
            self._etas[batch_id] = eta

    def new_batch(self, now: float, predicted_tokens: float, order_key: float) -> float:
        """The predicted finish of a batch of ``predicted_tokens`` about to be created with ``order_key``:
        the work at or before its key, plus its own (at the fleet's length correction)."""
        with self._lock:
            if self.rate_tps <= 0:
                return 0.0
            ahead = sum(e.remaining_tokens for b in self._batches if (e := self._etas.get(b.batch_id))
                        and b.order_key <= order_key)  # fmt: skip
            return now + (ahead + predicted_tokens * self.fleet_ratio) / self.rate_tps

    def at_submit(self, now: float, info: BatchInfo, tokens: float) -> Eta | None:
        """A new batch's predicted finish from the work ahead of it, kept until the next refresh, and whether it
        fits its window (never a silent miss: a batch at risk is logged); None while no rate is known."""
        finish = self.new_batch(now, tokens, info.order_key)
        if finish <= 0:
            return None
        eta = Eta(finish, tokens * self.fleet_ratio, self.fleet_ratio, 0.0, finish > info.deadline > 0)
        self.put(info.batch_id, eta)  # shown by GetBatch and /v1/batches until the next refresh
        if eta.at_risk:
            log.warning(
                "batch %s is at risk: predicted to finish in %.0f s, its window ends in %.0f s",
                info.batch_id,
                finish - now,
                info.deadline - now,
            )
        return eta
