"""Backoff offloading decisions: when an idle cluster should take queued work from a busy one.

Pure decision logic; the gateway carries a :class:`Move` out atomically with a Lua script.

* :func:`tail_move` -- how many queries to take from the *back* of one donor's queue for
  one recipient: the longest tail prefix (back first) such that every moved query still
  finishes earlier at the recipient, transfer included. For the frontmost moved query,
  ``queueing delay saved = its finish time at the donor - the recipient's finish time
  after the move`` must exceed ``transfer cost = link latency + bytes / bandwidth`` of the
  whole move. Both sides are monotone in the count, so the paying counts form a prefix and
  the largest one is the move that equalises the two finish times as far as it pays. Under the
  cost policy a cheaper recipient's move goes further, while the recipient finishes what it takes
  within its horizon (``until_s``, :func:`gateway.assign.cost_moves.fill_rule`; also a prefix).
* :func:`plan_offload` -- for an idle (or nearly idle) cluster: donors by expected finish
  time, busiest first; the first paying move wins.
* :class:`Backoff` -- an idle cluster that got nothing waits ``base * factor**(n-1)`` seconds
  (capped) after its ``n``-th fruitless ask; a successful ask resets it.

Finish times are ``pending_tokens / capacity_tps`` (tokens are prompt + predicted response). A
tail's queries come at their full size (:func:`gateway.assign.views.queued_loads`: no prefix
discount), the size :meth:`~gateway.assign.policies.ClusterView.fits` checks and the recipient is
charged.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from gateway.assign.policies import ClusterView, QueryLoad


@dataclass(frozen=True)
class LinkCost:
    """Cost of moving queued queries over one link: fixed latency plus bytes over bandwidth."""

    latency_s: float = 0.005
    bandwidth_bytes_per_s: float = 1.25e9

    def __post_init__(self) -> None:
        if not (math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise ValueError(f"link latency_s must be a finite number >= 0, not {self.latency_s!r}")
        if not (self.bandwidth_bytes_per_s > 0):
            raise ValueError(f"link bandwidth_bytes_per_s must be > 0, not {self.bandwidth_bytes_per_s!r}")

    def transfer_seconds(self, nbytes: int) -> float:
        """Seconds to move ``nbytes`` in one operation."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, not {nbytes}")
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s


@dataclass(frozen=True)
class Move:
    """Move ``count`` queries (``tokens`` predicted tokens in all) from ``src``'s queue to the back of ``dst``'s.

    ``keys`` are the planned queries' keys in their order on ``src`` (a move carries exactly
    those, never whatever sits at the back of the queue when it runs); plans compare equal
    whatever their keys.
    """

    src: str
    dst: str
    count: int
    tokens: float
    keys: tuple[str, ...] = field(default=(), compare=False)


def default_bytes_per_query(q: QueryLoad) -> int:
    """Rough wire size of a queued query: ~4 bytes per prompt token plus 512 bytes of envelope."""
    return 4 * q.prompt_tokens + 512


Links = Mapping[tuple[str, str], LinkCost] | LinkCost


def link_cost(links: Links, src: str, dst: str) -> LinkCost:
    """The cost of ``src -> dst``: one shared :class:`LinkCost`, or a per-pair mapping (either direction)."""
    if isinstance(links, LinkCost):
        return links
    for pair in ((src, dst), (dst, src)):
        try:
            return links[pair]
        except KeyError:
            continue
    raise ValueError(f"no link cost configured for {src} -> {dst}")


def _finish(work: float, capacity: float) -> float:
    if work <= 0:
        return 0.0
    return work / capacity if capacity > 0 else math.inf


def tail_move(
    donor: ClusterView,
    recipient: ClusterView,
    tail: Sequence[QueryLoad],
    link: LinkCost,
    bytes_per_query: Callable[[QueryLoad], int] | None = None,
    max_tokens: float = math.inf,
    until_s: float | None = None,
) -> Move | None:
    """The largest paying move of ``tail`` queries (back of ``donor``'s queue last) to ``recipient``, or None.

    With ``max_tokens``, a query is added only while it brings the moved total closer to
    ``max_tokens`` (``moved + q / 2 < max_tokens``), so the move ends within half a query of it. With ``until_s``
    (the cost policy's fill, :func:`gateway.assign.cost_moves.fill_rule`), a query also pays when the recipient
    finishes it within ``until_s`` seconds, transfer included, past equal finish times (it pays in cost: the
    recipient is the cheaper; ``math.inf``: up to ``max_tokens`` whatever the link).
    """
    if not recipient.usable or donor.name == recipient.name:
        return None
    size_of = bytes_per_query or default_bytes_per_query
    moved_tokens = 0.0
    moved_bytes = 0
    best: Move | None = None
    for count, q in enumerate(reversed(tail), 1):
        if not recipient.fits(q) or moved_tokens + q.total_tokens / 2 >= max_tokens:
            break
        at_donor = _finish(donor.pending_tokens - moved_tokens, donor.capacity_tps)
        moved_tokens += q.total_tokens
        moved_bytes += size_of(q)
        at_recipient = _finish(recipient.pending_tokens + moved_tokens, recipient.capacity_tps)
        transfer = link.transfer_seconds(moved_bytes)
        pays = at_donor - at_recipient > transfer
        if not pays and (until_s is None or at_recipient + transfer > until_s):
            break
        best = Move(donor.name, recipient.name, count, moved_tokens)
    if best is None:
        return None
    return replace(best, keys=tuple(q.key for q in tail[len(tail) - best.count :]))


def plan_offload(
    idle: ClusterView,
    others: Sequence[ClusterView],
    tails: Mapping[str, Sequence[QueryLoad]],
    links: Links,
    bytes_per_query: Callable[[QueryLoad], int] | None = None,
    idle_threshold_tokens: float = 0.0,
    allowed: Callable[[ClusterView, ClusterView], bool] | None = None,
    fill: Callable[[ClusterView, ClusterView], float | None] | None = None,
) -> Move | None:
    """What ``idle`` should take, if anything.

    Nothing when ``idle`` does not accept work or holds more than ``idle_threshold_tokens``.
    Otherwise donors are tried busiest first (expected finish time, ties by name); the first
    that yields a paying :func:`tail_move` is the answer. ``tails[c]`` holds the last queued
    queries of ``c``, back of the queue last. ``allowed(donor, idle)``: whether a move between them may be
    made at all (the cost policy's rule, :func:`gateway.assign.cost_moves.move_allowed`; None: every one).
    ``fill(donor, idle)``: seconds within which ``idle`` may finish what it takes past equal finish times (the cost
    policy's :func:`gateway.assign.cost_moves.fill_rule`; None, or a None answer: to equal finish times).
    """
    if idle_threshold_tokens < 0:
        raise ValueError(f"idle_threshold_tokens must be >= 0, not {idle_threshold_tokens}")
    if not idle.usable or idle.pending_tokens > idle_threshold_tokens:
        return None
    donors = [
        c for c in others if c.name != idle.name and tails.get(c.name) and (not allowed or allowed(c, idle))
    ]
    donors.sort(key=lambda c: (-_finish(c.pending_tokens, c.capacity_tps), c.name))
    for donor in donors:
        until_s = fill(donor, idle) if fill is not None else None
        link = link_cost(links, donor.name, idle.name)
        move = tail_move(donor, idle, tails[donor.name], link, bytes_per_query, until_s=until_s)
        if move is not None:
            return move
    return None


class Backoff:
    """Exponential backoff for one idle cluster asking for work; the clock is injectable."""

    def __init__(
        self,
        base_s: float = 0.5,
        factor: float = 2.0,
        max_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not base_s > 0:
            raise ValueError(f"backoff base_s must be > 0, not {base_s}")
        if not factor >= 1:
            raise ValueError(f"backoff factor must be >= 1, not {factor}")
        if not max_s >= base_s:
            raise ValueError(f"backoff max_s ({max_s}) must be >= base_s ({base_s})")
        self.base_s = base_s
        self.factor = factor
        self.max_s = max_s
        self._clock = clock
        self._failures = 0
        self._ready_at = -math.inf

    @property
    def failures(self) -> int:
        """Fruitless asks since the last success."""
        return self._failures

    @property
    def delay_s(self) -> float:
        """The wait imposed by the last failure (0 after a success)."""
        if self._failures == 0:
            return 0.0
        exponent = self._failures - 1
        if self.factor > 1 and exponent * math.log(self.factor) >= math.log(self.max_s / self.base_s):
            return self.max_s
        return min(self.max_s, self.base_s * self.factor**exponent)

    def ready(self) -> bool:
        """Whether the cluster may ask again now."""
        return self._clock() >= self._ready_at

    def failed(self) -> None:
        """The ask got nothing: wait longer before the next one."""
        self._failures += 1
        self._ready_at = self._clock() + self.delay_s

    def succeeded(self) -> None:
        """The ask got work: ask again at once next time."""
        self._failures = 0
        self._ready_at = -math.inf
