"""The endpoint backend's flow control, found from the endpoints' answers alone (no settings to tune).

* :class:`InflightLimit`: an AIMD limit on the requests in flight to one endpoint. While requests
  succeed with the limit in use and their seconds per generated token do not rise (within
  ``tolerance`` of the best recent figure), the limit grows by one per window (``1 / limit`` a
  success); an overload (429, 503, a refused connection, a timeout) halves it, once per window:
  requests sent before the last halving do not halve it again. With ``slow_start`` the limit first grows
  by one a success (doubling a window) until the first rise or overload, as TCP's slow start does: at
  one a window, going from 2 to 8 took 27 requests, an eighth of a 200-row batch at a quarter less
  concurrency.
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


@dataclass(frozen=True)
class FlowSettings:
    initial_limit: float = 2.0
    max_limit: int = 8  # most requests in flight to one endpoint (`fleetbatch engine serve --max-running`)
    tolerance: float = 0.5  # seconds per token this much above the best recent figure count as a rise
    smoothing: float = 0.3  # weight of a new seconds-per-token figure in the moving average
    drift: float = 0.02  # the best figure is let rise this much a success, so a slower server is relearnt
    backoff_base_s: float = 0.25
    backoff_max_s: float = 8.0
    slow_start: bool = False  # grow by one a success until the first rise or overload (module docstring)

    def __post_init__(self) -> None:
        if self.max_limit < 1:
            raise ValueError(f"the in-flight limit must be >= 1, got {self.max_limit}")
        if not 1 <= self.initial_limit <= self.max_limit:
            raise ValueError(f"the initial limit must be in [1, {self.max_limit}], got {self.initial_limit}")
        if self.backoff_base_s <= 0 or self.backoff_max_s < self.backoff_base_s:
            raise ValueError("backoff: need 0 < base_s <= max_s")


class InflightLimit:
    """AIMD limit of one endpoint's requests in flight (see the module's docstring)."""

    def __init__(self, settings: FlowSettings) -> None:
        self.settings = settings
        self.limit = float(settings.initial_limit)
        self.window = 0  # bumped by each halving; a request remembers the window it was sent in
        self.recent: float | None = None  # seconds per token, moving average
        self.best: float | None = None  # the lowest moving average, let drift up slowly
        self.slow_start = settings.slow_start  # until the first rise or overload

    @property
    def slots(self) -> int:
        """Requests that may be in flight now."""
        return max(1, math.floor(self.limit + 1e-9))

    def succeeded(self, seconds_per_token: float | None, saturated: bool) -> None:
        """A request came back whole: ``seconds_per_token`` its time per generated token (None: it
        generated none), ``saturated`` whether the limit was in use. Grows the limit when it was and
        the time per token has not risen."""
        s = self.settings
        if seconds_per_token is not None and seconds_per_token >= 0:
            self.recent = (
                seconds_per_token
                if self.recent is None
                else (1 - s.smoothing) * self.recent + s.smoothing * seconds_per_token
            )
            self.best = self.recent if self.best is None else min(self.recent, self.best * (1 + s.drift))
        risen = (
            self.recent is not None and self.best is not None and self.recent > self.best * (1 + s.tolerance)
        )
        if risen:
            self.slow_start = False
        elif saturated:
            self.limit = min(float(s.max_limit), self.limit + (1.0 if self.slow_start else 1.0 / self.limit))

    def overloaded(self, sent_in_window: int) -> bool:
        """The endpoint answered a request sent in window ``sent_in_window`` with an overload: halve
        the limit unless it was halved since that request was sent; True when it was halved now."""
        self.slow_start = False
        if sent_in_window < self.window:
            return False
        self.limit = max(1.0, self.limit / 2)
        self.window += 1
        return True


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
    limit: InflightLimit
    backoff: Backoff
    inflight: int = 0

    @classmethod
    def of(cls, url: str, settings: FlowSettings) -> Lane:
        return cls(url, InflightLimit(settings), Backoff(settings))

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
