"""Background intake's bookkeeping beyond landing rows: which batches are in intake (a page at a
time), where a batch's next chunk starts, how long a batch has waited for a cluster, and what
becomes of a batch whose intake list was lost.

**Waiting.** A chunk whose rows only a cluster that is not alive now could take waits for it
(see :mod:`gateway.placement`); the batch hash remembers since when (``intake_waiting_since``,
the caller's clock), so the bound on the wait holds across gateway replicas and restarts.

**A lost intake list** (evicted, deleted by hand, lost in a failover) leaves rows that can
never be enqueued: their ids were in it. :meth:`IntakeOps.fail_lost_intake` counts them as
failed (``cancelled`` when the batch is being cancelled) in one script call, records how many
(``intake_lost``) and why (``error``), takes the batch out of the intake set and, when nothing
else of it is queued or running, gives it its final status (``failed`` when nothing completed).
The rows have no result line: only their count survives. The queue invariants
(:mod:`workqueue.invariants`) count ``intake_lost`` among the finished.
"""

from __future__ import annotations

from collections.abc import Callable

import redis

from workqueue import keys, scripts
from workqueue.batches import INTAKE, intake_key
from workqueue.records import as_int

WAITING = "intake_waiting_since"  # batch hash field: when intake began to wait for a cluster
LOST = "intake_lost"  # batch hash field: rows counted finished because the intake list was lost

# KEYS: batch hash. ARGV: now, the field. Since when the batch waits (now if it did not); nil: no batch.
WAIT = """
if redis.call('HEXISTS', KEYS[1], 'status') == 0 then return false end
redis.call('HSETNX', KEYS[1], ARGV[2], ARGV[1])
return redis.call('HGET', KEYS[1], ARGV[2])
"""

# KEYS: batch hash, intake list, intake set. ARGV: batch id, why, now.
# Returns the rows counted lost; 0: nothing was left to enqueue; -1: the list is there; -2: no batch.
LOST_INTAKE = (
    scripts.PRELUDE
    + r"""
local b, bid = KEYS[1], ARGV[1]
local h = redis.call('HMGET', b, 'status', 'intake_done', 'intake_total')
if not h[1] then return -2 end
if redis.call('EXISTS', KEYS[2]) == 1 then return -1 end
local total = tonumber(h[3] or '0')
local lost = total - tonumber(h[2] or '0')
redis.call('ZREM', KEYS[3], bid)
if lost <= 0 then return 0 end
local kind = 'failed'
if h[1] == 'cancelling' or h[1] == 'cancelled' then kind = 'cancelled' end
redis.call('HINCRBY', b, kind, lost)
redis.call('HSET', b, 'intake_done', total, '"""
    + LOST
    + """', lost, 'error', ARGV[2])
settle(bid, ARGV[3])
return lost
"""
)


class IntakeOps:
    """Intake waits and lost intake lists; mixed into :class:`workqueue.queue.WorkQueue`."""

    r: redis.Redis
    clock: Callable[[], float]

    def _init_intake_ops(self, client: redis.Redis) -> None:
        self._wait = client.register_script(WAIT)
        self._lost_intake = client.register_script(LOST_INTAKE)

    def intake_page(self, start: int, n: int) -> list[str]:
        """Up to ``n`` ids of batches in intake, from index ``start`` of the intake set (oldest first)."""
        return self.r.zrange(INTAKE, start, start + n - 1)

    def intake_head(self, batch_id: str) -> tuple[str | None, int, int, str]:
        """``(status, intake_done, intake_total, created_at)`` of a batch in intake: where its next
        chunk starts, and which batch it is (a batch created again under the id has another
        ``created_at``); no rows are read."""
        h = self.r.hmget(keys.batch(batch_id), "status", "intake_done", "intake_total", "created_at")
        return h[0], as_int(h[1]), as_int(h[2]), h[3] or ""

    def intake_wait(self, batch_id: str) -> float | None:
        """Since when the batch's intake waits for a cluster (starting now if it was not waiting);
        None when the batch does not exist."""
        since = self._wait(keys=[keys.batch(batch_id)], args=[self.clock(), WAITING])
        return None if since is None else float(since)

    def intake_waited(self, batch_id: str) -> None:
        """The batch's intake no longer waits (a chunk found a cluster for every row)."""
        self.r.hdel(keys.batch(batch_id), WAITING)

    def fail_lost_intake(self, batch_id: str, why: str) -> int:
        """Count the rows of a batch whose intake list is gone as failed (see the module docstring);
        returns how many, 0 when none were left, -1 when the list exists after all, -2 without a batch."""
        k = [keys.batch(batch_id), intake_key(batch_id), INTAKE]
        return int(self._lost_intake(keys=k, args=[batch_id, why, self.clock()]))
