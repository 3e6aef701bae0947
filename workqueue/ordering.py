"""The order of each cluster's queue: earliest deadline first (or first in, first out), one rule.

Each cluster's queue is a sorted set of query ids scored by :func:`rank`: the *order key* of
the query's batch, in whole seconds, then the query's place in the order the gateway enqueued
it (a deployment-wide sequence, ``{fb}:seq``, reserved a batch or an intake chunk at a time).
The lowest rank runs first; a query requeued after its worker died, or moved to another
cluster, keeps its rank, so it goes back to its place in the order, not to the back.

**The order key** (:meth:`QueueOrder.key`, computed once when the batch is created):

* ``edf`` (the default): the batch's deadline (creation + completion window), minus
  ``priority * priority_step_s``. A batch without a deadline is keyed as if its window were
  the OpenAI default (24 h).
* ``fifo``: the batch's creation time, minus ``priority * priority_step_s``.

Within one order key (to the second) queries run in the order they were enqueued: a batch's
own order (the token policies put its longest predicted queries first) and, across batches,
the order they were submitted in.

**No batch starves.** Keys are fixed at creation, and a batch created at ``t`` gets a key of
at least ``t + min window - max priority * priority_step_s``. So a waiting batch with key ``k``
can be overtaken only by batches created before ``k + max priority * step - min window``: its
wait is bounded, however many batches arrive after it. Priorities are that same mechanism:
one level moves a batch ahead of batches whose deadlines are up to ``priority_step_s`` earlier.

A rank is a Redis score (a double, exact to 2**53): whole seconds since 2025 times
:data:`SPAN`, plus the sequence number modulo :data:`SPAN` (about 4 million). At the rare
point where the sequence wraps, queries of one second's key may run out of their submission
order; the order by key is unaffected.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MODES = ("edf", "fifo")
EPOCH = 1_735_689_600  # 2025-01-01T00:00:00Z: ranks count seconds from here
SPAN = 1 << 22  # sequence numbers per second of order key
DEFAULT_WINDOW_S = 24 * 3600.0  # the key of a batch without a deadline (edf): as if its window were 24 h
DEFAULT_PRIORITY_STEP_S = 3600.0
MAX_PRIORITY_STEP_S = 30 * 86400.0  # with priorities up to 100, keys stay within about 2**31 s of EPOCH


@dataclass(frozen=True)
class QueueOrder:
    """How batches are ordered in every cluster's queue (see the module docstring)."""

    mode: str = "edf"
    priority_step_s: float = DEFAULT_PRIORITY_STEP_S

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"queue order must be one of {', '.join(MODES)}, not {self.mode!r}")
        if not (math.isfinite(self.priority_step_s) and 0 <= self.priority_step_s <= MAX_PRIORITY_STEP_S):
            raise ValueError(
                f"priority_step_s must be in [0, {MAX_PRIORITY_STEP_S:.0f}] (30 days: ranks stay exact), "
                f"not {self.priority_step_s}"
            )

    def key(self, created_at: float, deadline: float = 0.0, priority: int = 0) -> float:
        """The batch's order key, in seconds: earliest runs first."""
        base = created_at if self.mode == "fifo" else (deadline or created_at + DEFAULT_WINDOW_S)
        return base - priority * self.priority_step_s


def rank(order_key: float, seq: int) -> int:
    """The queue score of the query with sequence number ``seq`` in a batch with ``order_key``."""
    return (math.floor(order_key) - EPOCH) * SPAN + seq % SPAN


def lua_rank() -> str:
    """``local function rank(order_key, seq)``: :func:`rank` for the scripts (integers exact in doubles)."""
    return f"local function rank(order_key, seq) return (math.floor(order_key) - {EPOCH}) * {SPAN} + seq % {SPAN} end\n"
