"""What every part of the queue shares, passed to each part explicitly: :class:`QueueCore`.

:class:`workqueue.queue.WorkQueue` is composed of parts, each a class with one job
(:mod:`workqueue.clusters`, :mod:`workqueue.leases`, :mod:`workqueue.batches`,
:mod:`workqueue.intake_ops`, :mod:`workqueue.moves`, :mod:`workqueue.ticks`). Each takes a
:class:`QueueCore` (the Redis client, the clock, the queue order and the two settings) and,
where it needs another part, that part through a ``Protocol`` its module declares; nothing
else is shared between them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import redis
from redis.commands.core import Script

from workqueue.ordering import QueueOrder

__all__ = ["DEFAULT_MAX_ATTEMPTS", "DEFAULT_RETENTION_S", "QueueCore"]

DEFAULT_MAX_ATTEMPTS = 3  # claims a query gets (see workqueue.leases)
DEFAULT_RETENTION_S = 7 * 24 * 3600  # finished batches (status, results) are kept a week


@dataclass(frozen=True)
class QueueCore:
    """The queue's shared context (see the module's docstring).

    ``r``: the client (thread-safe: redis-py pools connections); ``clock`` stamps records (lease
    deadlines use Redis time whatever it says) and is the clock batch deadlines are set and
    checked on; ``order``: how batches are ordered in the queues (:mod:`workqueue.ordering`);
    ``max_attempts``: claims a query gets, 0 for no limit (:mod:`workqueue.leases`);
    ``retention_s``: how long a finished batch is kept, 0 for ever (:mod:`workqueue.batches`).
    Build one with :meth:`create`, which checks and normalizes the settings.
    """

    r: redis.Redis
    clock: Callable[[], float] = time.time
    order: QueueOrder = field(default_factory=QueueOrder)
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    retention_s: int = DEFAULT_RETENTION_S

    @classmethod
    def create(
        cls,
        client: redis.Redis,
        *,
        clock: Callable[[], float] = time.time,
        max_attempts: int | None = DEFAULT_MAX_ATTEMPTS,
        retention_s: float = DEFAULT_RETENTION_S,
        order: QueueOrder | None = None,
    ) -> QueueCore:
        """The core of a queue on ``client``; ``max_attempts`` None or 0: no limit; ``retention_s`` 0: forever."""
        if max_attempts is not None and max_attempts < 0:
            raise ValueError(f"max_attempts must be >= 0 or None, not {max_attempts}")
        if not retention_s >= 0:
            raise ValueError(f"retention_s must be >= 0 (0: keep forever), not {retention_s}")
        return cls(client, clock, order or QueueOrder(), max_attempts or 0, int(retention_s))

    def script(self, source: str) -> Script:
        """``source`` registered on the client (an ``EVALSHA`` script, loaded when Redis lacks it)."""
        return self.r.register_script(source)
