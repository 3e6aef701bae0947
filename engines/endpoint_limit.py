"""How many requests one endpoint gets at once, found from its answers alone: a climb on its throughput.

A server that batches (vLLM, SGLang, TGI, ``transformers serve --continuous-batching``) answers each
request more slowly the more it runs at once, while its total rate still rises: on the random-weights
``small`` Llama under ``transformers serve``, 8 in flight gave 170 completion tokens/s, 16 gave 199 and
32 gave 171, each request's time per token rising all the way. A limit that stops growing when that
time rises stays at a few requests; one that grows until an overload sits far past the best. So the
limit follows the endpoint's total completion tokens per second, measured over windows of answers:

* a window starts when the limit changes, leaves out the first half-limit of answers (requests sent
  under the old limit) and measures the next ``max(MIN_WINDOW, limit // 2)``: their tokens over the
  time they took to come; a window in which the limit was not in use (on average fewer than
  ``IN_USE`` of it in flight at its answers: too few requests to send) measures nothing;
* **climbing**: from ``initial_limit`` the limit doubles each window while the rate rises by more
  than five times ``gain``, and grows by half while it rises by more than ``gain`` (a window past the
  best, 16 -> 24 on that server, costs less than 16 -> 32); the first window that does not, the climb
  ends;
* **holding**: the limit is the level of the best rate measured (each level's rate a moving average
  of its windows). A level more than ``gain`` below the best is left for the best, and it and every
  level above it stop being tried (the ceiling). After ``hold_windows`` windows at the best, the limit
  probes one step up (a quarter more) and comes back if that is not better; a ceiling in the way rises
  a step instead, so a server that got faster (or came back) is found again;
* an overload (429, 503, a refused connection, a timeout) halves the limit at once, once per round of
  requests (:meth:`ThroughputLimit.overloaded`), and the ceiling comes down to the level it was at.

The limit never exceeds ``max_limit`` (``fleetbatch engine serve --max-running`` when given).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: fewest answers a window measures
MIN_WINDOW = 4
#: the share of the limit that must be in flight, on average over a window's answers, for it to count: the
#: worker refills a slot a few tens of milliseconds after its answer, so "all of it at every answer" is rare
IN_USE = 0.75


@dataclass
class _Window:
    level: int
    skip: int  # answers still to leave out
    size: int  # answers to measure
    started: float | None = None  # when the last left-out answer came (the measured span starts)
    tokens: int = 0
    answers: int = 0
    inflight: int = 0  # the requests in flight at each measured answer, summed


class ThroughputLimit:
    """The in-flight limit of one endpoint (see the module's docstring)."""

    def __init__(
        self, initial_limit: float, max_limit: int, gain: float = 0.05, hold_windows: int = 10
    ) -> None:
        self.max_limit = max_limit
        self.gain = gain
        self.hold_windows = hold_windows
        self.limit = float(min(max_limit, max(1, math.floor(initial_limit))))
        self.window = 0  # bumped by each halving; a request remembers the round it was sent in
        self.rates: dict[int, float] = {}  # completion tokens/s measured at each level (moving average)
        self.ceiling = max_limit + 1  # levels at or above this measured worse than the best
        self.climbing = True
        self._held = 0  # windows measured at the best level since the last probe
        self._measure = self._new_window()

    @property
    def slots(self) -> int:
        """Requests that may be in flight now."""
        return max(1, math.floor(self.limit + 1e-9))

    def _new_window(self) -> _Window:
        level = self.slots
        return _Window(level, skip=level // 2, size=max(MIN_WINDOW, level // 2))

    def _set(self, level: int) -> None:
        self.limit = float(max(1, min(self.max_limit, level)))
        self._measure = self._new_window()

    def succeeded(self, tokens: int, now: float, inflight: int) -> None:
        """A request came back whole at ``now`` with ``tokens`` completion tokens, ``inflight`` requests (it
        among them) in flight to the endpoint when it came."""
        w = self._measure
        if w.skip > 0:
            w.skip -= 1
            w.started = now
            return
        if w.started is None:
            w.started = now
            return
        w.tokens += tokens
        w.answers += 1
        w.inflight += inflight
        if w.answers < w.size:
            return
        if w.inflight < IN_USE * w.level * w.answers or now <= w.started:  # nothing learnt: measure again
            self._measure = self._new_window()
            return
        self._decide(w.level, w.tokens / (now - w.started))

    def _decide(self, level: int, rate: float) -> None:
        below = max((lvl for lvl in self.rates if lvl < level), default=None)
        old = self.rates.get(level)
        self.rates[level] = rate if old is None else (old + rate) / 2
        best = max(self.rates, key=self.rates.__getitem__)
        if self.climbing:
            if below is None or rate > self.rates[below] * (1 + self.gain):
                steep = below is None or rate > self.rates[below] * (1 + 5 * self.gain)
                up = 2 * level if steep else math.ceil(1.5 * level)  # a flattening climb takes shorter steps
                return self._set(min(up, self.ceiling - 1))
            self.climbing = False
        if self.rates[level] < self.rates[best] * (1 - self.gain):
            if level > best:
                self.ceiling = min(self.ceiling, level)
            self._held = 0
            return self._set(best)
        if level != best:  # within the gain of the best: keep the best
            return self._set(best)
        self._held += 1
        if self._held >= self.hold_windows:
            self._held = 0
            step = max(1, level // 4)
            if level + step >= self.ceiling:  # a ceiling is old news after a while: it rises a step
                self.ceiling = min(self.max_limit + 1, self.ceiling + max(1, self.ceiling // 4))
            if level + step < self.ceiling:
                return self._set(level + step)
        self._measure = self._new_window()

    def overloaded(self, sent_in_window: int) -> bool:
        """The endpoint answered a request sent in round ``sent_in_window`` with an overload: halve the
        limit unless it was halved since that request was sent; True when it was halved now."""
        self.climbing = False
        if sent_in_window < self.window:
            return False
        self.ceiling = min(self.ceiling, max(2, self.slots))
        self.window += 1
        self._set(max(1, self.slots // 2))
        return True
