"""The endpoint backend's flow control, found from the endpoints' answers alone (no settings to tune).

* :class:`~engines.endpoint_limit.ThroughputLimit`: the requests in flight to one endpoint, climbed to
  the level of its best completion tokens per second and halved on an overload (429, 503, a refused
  connection, a timeout).
* :class:`Backoff`: an endpoint that is overloaded, restarting or unreachable gets nothing for a
  while, doubling from ``base_s`` to ``max_s`` (at least its ``Retry-After``); one success resets it.
* :func:`least_loaded`: several endpoints share the load, the least in flight first.
* :class:`RateMeter`: the completion tokens per second of the time the endpoints were busy.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from engines.endpoint_limit import ThroughputLimit


@dataclass(frozen=True)
class FlowSettings:
    initial_limit: float = 4.0
    max_limit: int = 256  # most requests in flight to one endpoint (`fleetbatch engine serve --max-running`)
    backoff_base_s: float = 0.25
    backoff_max_s: float = 8.0

    def __post_init__(self) -> None:
        if self.max_limit < 1:
            raise ValueError(f"the in-flight limit must be >= 1, got {self.max_limit}")
        if not 1 <= self.initial_limit <= self.max_limit:
            raise ValueError(f"the initial limit must be in [1, {self.max_limit}], got {self.initial_limit}")
        if self.backoff_base_s <= 0 or self.backoff_max_s < self.backoff_base_s:
            raise ValueError("backoff: need 0 < base_s <= max_s")


class Backoff:
    """How long an endpoint gets nothing after it was overloaded or unreachable (module docstring).
    Requests that were in flight together fail together: only one sent after the last failure
    doubles the wait, so one outage seen by eight requests waits ``base_s``, not ``2**7 x base_s``."""

    def __init__(self, settings: FlowSettings) -> None:
        self.settings = settings
        self.failures = 0  # in a row
        self.failed_at = -math.inf  # when the last failure came
        self.until = 0.0  # when it may be asked again

    def failed(self, now: float, sent_at: float, retry_after_s: float | None = None) -> float:
        """A request sent at ``sent_at`` failed at ``now``; returns the wait before the endpoint is asked again."""
        s = self.settings
        if sent_at >= self.failed_at or self.failures == 0:
            self.until = now + min(s.backoff_max_s, s.backoff_base_s * 2**self.failures)
            self.failures += 1
        if retry_after_s is not None and retry_after_s > 0:
            self.until = max(self.until, now + min(retry_after_s, s.backoff_max_s))
        self.failed_at = now
        return max(0.0, self.until - now)

    def succeeded(self) -> None:
        self.failures = 0
        self.until = 0.0

    def ready(self, now: float) -> bool:
        return now >= self.until


@dataclass
class Lane:
    """One endpoint as the flow control sees it: its limit, its backoff and its requests in flight."""

    url: str
    limit: ThroughputLimit
    backoff: Backoff
    inflight: int = 0

    @classmethod
    def of(cls, url: str, settings: FlowSettings) -> Lane:
        return cls(url, ThroughputLimit(settings.initial_limit, settings.max_limit), Backoff(settings))

    def open(self, now: float) -> bool:
        """Whether it may take one more request now."""
        return self.backoff.ready(now) and self.inflight < self.limit.slots


def least_loaded(lanes: Sequence[Lane], now: float) -> Lane | None:
    """The open lane with the fewest requests in flight (the first of equals); None when none is open."""
    open_lanes = [lane for lane in lanes if lane.open(now)]
    return min(open_lanes, key=lambda lane: lane.inflight) if open_lanes else None


def next_opening(lanes: Sequence[Lane], now: float) -> float | None:
    """Seconds until a backing-off lane may be asked again (None: none is backing off)."""
    waits = [lane.backoff.until - now for lane in lanes if not lane.backoff.ready(now)]
    return max(0.0, min(waits)) if waits else None


@dataclass
class RateMeter:
    """Completion tokens per second of busy time (some request in flight), over the last ``window_s``."""

    window_s: float = 30.0
    busy_s: float = 0.0  # busy seconds so far
    tokens: int = 0  # completion tokens so far
    _busy_since: float | None = None
    _samples: deque[tuple[float, int]] = field(default_factory=lambda: deque([(0.0, 0)]))

    def busy(self, now: float, inflight: int) -> None:
        """The number of requests in flight changed to ``inflight`` at ``now``."""
        if inflight > 0 and self._busy_since is None:
            self._busy_since = now
        elif inflight == 0 and self._busy_since is not None:
            self.busy_s += now - self._busy_since
            self._busy_since = None

    def add(self, now: float, tokens: int) -> None:
        """A request finished at ``now`` with ``tokens`` completion tokens."""
        self.tokens += tokens
        busy = self.busy_at(now)
        self._samples.append((busy, self.tokens))
        while len(self._samples) > 2 and self._samples[1][0] < busy - self.window_s:
            self._samples.popleft()

    def busy_at(self, now: float) -> float:
        return self.busy_s + (now - self._busy_since if self._busy_since is not None else 0.0)

    def rate(self) -> float:
        """Tokens per busy second over the window (0 before anything finished)."""
        (b0, t0), (b1, t1) = self._samples[0], self._samples[-1]
        return (t1 - t0) / (b1 - b0) if b1 > b0 else 0.0
