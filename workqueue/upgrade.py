"""Queues written by a version before deadlines were Redis lists; today's are sorted sets (:mod:`workqueue.ordering`).

:func:`upgrade_queues` turns every cluster's list, in one script call each, into the sorted set the
same queries would have today: each id ranked by its batch's order key (its ``order_key``, or its
creation plus the default 24 h window, as an earliest-deadline-first queue keys a batch without a
deadline) and its place in the list, so the old order holds among batches of one key. The gateway
runs it at start-up, before it serves; a queue that is already a sorted set is left alone, so it
is safe to run again and on every replica.
"""

from __future__ import annotations

import redis

from workqueue import keys
from workqueue.scripts import PRELUDE

# KEYS: the cluster's queue. ARGV: the default window (s). Returns how many ids moved from the list to the sorted set,
# -1 when the queue was not a list (nothing to do).
UPGRADE_QUEUE = (
    PRELUDE
    + r"""
if redis.call('TYPE', KEYS[1])['ok'] ~= 'list' then return -1 end
local ids = redis.call('LRANGE', KEYS[1], 0, -1)
redis.call('DEL', KEYS[1])
local seq = redis.call('INCRBY', K_SEQ, #ids) - #ids
local keyed = {}
for i, g in ipairs(ids) do
  local bid = split_gid(g)
  if keyed[bid] == nil then
    local h = redis.call('HMGET', k_batch(bid), 'order_key', 'created_at')
    keyed[bid] = tonumber(h[1] or '') or (tonumber(h[2] or '0') + tonumber(ARGV[1]))
  end
  local r = rank(keyed[bid], seq + i)
  redis.call('ZADD', KEYS[1], r, g)
  if redis.call('EXISTS', k_query(g)) == 1 then redis.call('HSET', k_query(g), 'rank', r) end
end
return #ids
"""
)


def upgrade_queues(client: redis.Redis, default_window_s: float) -> dict[str, int]:
    """Every registered cluster's queue as a sorted set; returns how many ids each list held (only those upgraded)."""
    script = client.register_script(UPGRADE_QUEUE)
    out = {}
    for c in sorted(client.smembers(keys.CLUSTERS)):
        n = int(script(keys=[keys.queue(c)], args=[default_window_s]))
        if n >= 0:
            out[c] = n
    return out
