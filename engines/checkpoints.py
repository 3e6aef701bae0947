"""Checkpoints and preemption notices of one worker: partial outputs to Redis, preempted queries given back.

A worker's running queries lose nothing but their last few tokens when its cluster goes away:

* **Checkpoints.** After each step the step loop snapshots every running query that generated
  ``every / 2`` tokens (rounded up) since its last snapshot (:meth:`Checkpoints.after_step`); the
  queue agent writes the snapshots in its next tick, in the same round trip as its renewals,
  results and claims (:mod:`workqueue.worker_tick`: the CHECKPOINT script, which writes only while
  this worker holds the query). A tick is made for them alone only when a query gets three
  quarters of a checkpoint ahead of Redis. The step loop does not step a query that is ``every`` tokens ahead of its last
  written snapshot (:meth:`Checkpoints.wait_written`, while Redis answers): so a hard kill loses at
  most ``every`` tokens of a query, however slow a tick was.
* **Notices.** A preemption notice (``fleetbatch gateway rebalance --preempt CLUSTER --notice S``,
  read by the agent's tick, or SIGTERM to an engine served with ``--grace-s S``) sets the time it
  ends (:meth:`Checkpoints.notice`). From then on the worker claims nothing; the queries it claimed
  ahead go back at once; a running query that will not finish within the notice at its decode
  rate (:func:`doomed`) is taken out of the engine and given back with its tokens as its partial
  output (:meth:`Checkpoints.release`), without using an attempt; the others finish.

The step loop and the agent's thread share this object (its own lock): the step loop takes
snapshots and waits, the agent sends them (:meth:`for_tick`) and records what Redis wrote
(:meth:`applied`).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

from workqueue.partial import Partial

#: a query is left to finish under a notice only if it will end this many seconds before the notice does (at least)
NOTICE_MARGIN_S = 0.5

Item = tuple[str, Partial | None, bool]  # (gid, partial output or None, release): one checkpoint of a tick


class Checkpoints:
    """A worker's checkpoints (every ``every`` tokens a query; 0: none but a notice's) and its notice."""

    def __init__(self, every: int = 64) -> None:
        self.every = max(0, int(every))
        self._cond = threading.Condition()
        self._pending: dict[str, tuple[Partial | None, bool]] = {}  # to send with the next tick
        self._written: dict[str, int] = {}  # tokens of each query's partial output in Redis
        self._taken: dict[str, int] = {}  # tokens of its last snapshot (step loop only)
        self.notice_at: float | None = None  # when the notice ends (time.monotonic()); None: no notice

    # ------------------------------------------------------------------ the step loop's side

    def start(self, gid: str, resumed: int = 0) -> None:
        """A query starts, from a partial output of ``resumed`` tokens (already in Redis)."""
        with self._cond:
            self._written[gid] = resumed
        self._taken[gid] = resumed

    def forget(self, gids: Iterable[str]) -> None:
        """Queries that finished: nothing more to checkpoint."""
        with self._cond:
            for g in gids:
                self._taken.pop(g, None)
                self._written.pop(g, None)
                entry = self._pending.get(g)
                if entry is not None and not entry[1]:
                    del self._pending[g]

    def after_step(self, progress: Mapping[str, int], partial: Callable[[str], Partial | None]) -> bool:
        """Snapshot (``partial(gid)``) the queries half a checkpoint ahead of their last snapshot, by ``progress``
        (tokens generated, per query). The snapshots go with the agent's next tick, due anyway (renewals, results,
        claims); returns whether one is urgent: a query three quarters of a checkpoint ahead of Redis (then the
        agent should tick now, before the step loop has to wait)."""
        if not self.every:
            return False
        half, urgent = max(1, math.ceil(self.every / 2)), math.ceil(3 * self.every / 4)
        due = [g for g, n in progress.items() if n - self._taken.get(g, 0) >= half]
        snapshots = [(g, partial(g)) for g in due]
        with self._cond:
            for g, snap in snapshots:
                self._taken[g] = progress[g]
                if not snap:  # nothing it could resume from (a row that must run again from the start)
                    self._written[g] = progress[g]  # so it is never behind
                elif not self._pending.get(g, (None, False))[1]:  # a release carries the query's tokens
                    self._pending[g] = (snap, False)
            return bool(self._pending) and any(
                n - self._written.get(g, 0) >= urgent for g, n in progress.items()
            )

    def behind(self, progress: Mapping[str, int]) -> bool:
        """Whether a query would run more than a checkpoint ahead of its written partial output in the next step."""
        if not self.every:
            return False
        with self._cond:
            return any(n - self._written.get(g, 0) >= self.every for g, n in progress.items())

    def wait_written(self, progress: Mapping[str, int], timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) until no query is a checkpoint ahead of Redis; False if one still is."""
        end = time.monotonic() + timeout_s
        with self._cond:
            while any(n - self._written.get(g, 0) >= self.every for g, n in progress.items()):
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def release(self, gid: str, partial: Partial | None) -> None:
        """Give a query back with the next tick (without using an attempt), with ``partial`` as its partial output
        (None: keep what a snapshot not yet sent, or Redis, holds; nor is one shorter than Redis's written)."""
        with self._cond:
            keep = partial if partial is not None else self._pending.get(gid, (None, False))[0]
            if keep is not None and len(keep) < self._written.get(gid, 0):
                keep = None  # Redis holds a longer one (the partial output this run did not resume from)
            self._pending[gid] = (keep, True)
        self._taken.pop(gid, None)

    # ------------------------------------------------------------------ the agent's side

    def for_tick(self, skip: Iterable[str] = ()) -> list[Item]:
        """The checkpoints to send now (they stay pending until :meth:`applied`); ``skip``: queries finished."""
        skip = set(skip)
        with self._cond:
            return [(g, p, r) for g, (p, r) in self._pending.items() if g not in skip]

    def releasing(self) -> set[str]:
        """Queries being given back: not to renew (a renewal would take them back from the queue)."""
        with self._cond:
            return {g for g, (_, r) in self._pending.items() if r}

    def pending(self) -> int:
        with self._cond:
            return len(self._pending)

    def applied(self, items: Sequence[Item]) -> list[str]:
        """A tick sent ``items`` and Redis answered (each written, or the query is another run's now: either way a
        snapshot sent needs no resend); returns the queries given back."""
        released = []
        with self._cond:
            for g, partial, release in items:
                entry = self._pending.get(g)
                if (
                    entry is not None and entry[0] is partial and entry[1] == release
                ):  # else a newer one: send it
                    del self._pending[g]
                if release:
                    released.append(g)
                    self._written.pop(g, None)
                elif partial is not None:
                    self._written[g] = max(self._written.get(g, 0), len(partial))
            self._cond.notify_all()
        return released

    # ------------------------------------------------------------------ the notice

    def notice(self, ends_at: float) -> bool:
        """A notice that ends at ``ends_at`` (``time.monotonic()``); an earlier end is kept. Whether it is new."""
        with self._cond:
            new = self.notice_at is None
            self.notice_at = ends_at if new else min(self.notice_at, ends_at)
            self._cond.notify_all()
        return new

    @property
    def noticed(self) -> bool:
        return self.notice_at is not None


def doomed(
    running: Mapping[str, tuple[int, int]],
    per_query_tps: float,
    left_s: float,
    margin_s: float = NOTICE_MARGIN_S,
) -> list[str]:
    """The running queries that will not finish within a notice's ``left_s`` seconds: per query (tokens generated,
    most tokens it may generate), at ``per_query_tps`` tokens/s each (0: not measured yet), with ``margin_s`` to spare.
    Within the margin every query is doomed; before the first rate is measured none is."""
    if left_s <= margin_s:
        return sorted(running)
    if per_query_tps <= 0:
        return []
    budget = (left_s - margin_s) * per_query_tps
    return sorted(g for g, (done, most) in running.items() if most - done > budget)
