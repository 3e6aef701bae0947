"""One mover at a time: a lease in Redis held by whoever moves queued work between clusters.

Tail moves come from the offloader of every gateway replica and from admin rebalance. Each
reads the queues, plans, then moves; two planners working from the same snapshot would both
move the same surplus (work ping-pongs, and a queue can be emptied twice over). So a mover
takes the lease (a :class:`workqueue.lease.Lease` on ``keys.MOVER``) before it reads and gives it
back after its last move. A mover that dies holding it blocks others for at most ``ttl_s``.
"""

from __future__ import annotations

import time
import uuid
from types import TracebackType

import redis

from workqueue import keys
from workqueue.lease import Lease


class MoverLease:
    """``with queue.mover_lease("offloader") as held:`` -- ``held`` says whether this caller may move.

    ``wait_s`` > 0 retries for that long (every ``poll_s``) before giving up.
    """

    def __init__(
        self, client: redis.Redis, owner: str, ttl_s: float = 30.0, wait_s: float = 0.0, poll_s: float = 0.05
    ) -> None:
        if not ttl_s > 0:
            raise ValueError(f"mover lease ttl_s must be > 0, not {ttl_s}")
        self.lease = Lease(client, keys.MOVER, f"{owner}:{uuid.uuid4().hex}", ttl_s)
        self.token = self.lease.token
        self.wait_s = wait_s
        self.poll_s = poll_s
        self.held = False

    def acquire(self) -> bool:
        deadline = time.monotonic() + self.wait_s
        while True:
            self.held = self.lease.acquire()
            if self.held or time.monotonic() >= deadline:
                return self.held
            time.sleep(self.poll_s)

    def release(self) -> None:
        if self.held:
            self.lease.release()
            self.held = False

    def holder(self) -> str | None:
        """Who holds the lease now (``owner:token``), if anyone."""
        return self.lease.holder()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()
