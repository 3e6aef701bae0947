"""Queues written by a version before deadlines were Redis lists; today's are sorted sets (:mod:`workqueue.ordering`).

:func:`upgrade_queues` turns every cluster's list, in one script call each, into the sorted set the
same queries would have today: each id ranked by its batch's order key (its ``order_key``, else the
gateway's :class:`~workqueue.ordering.QueueOrder` key of a batch created then without a deadline,
written into the batch hash) and its place in the list, so the old order holds among batches of one
key. Batches still in background intake get their key too, so their next chunks land in order. The
gateway runs it at start-up, before it serves; a queue that is already a sorted set is left alone
and a key already written is kept, so it is safe to run again and on every replica.
"""

from __future__ import annotations

import redis

from workqueue import keys
from workqueue.batches import INTAKE
from workqueue.lua_queue import LIBRARY
from workqueue.ordering import QueueOrder

ORDER_KEY_OF = r"""
-- A batch's order key: the one in its hash, else its creation plus `after` seconds, written into its hash.
local function order_key_of(bid, after)
  local h = redis.call('HMGET', k_batch(bid), 'order_key', 'created_at', 'status')
  if h[1] then return tonumber(h[1]) end
  local key = tonumber(h[2] or '0') + after
  if h[3] then redis.call('HSET', k_batch(bid), 'order_key', key) end
  return key
end
"""
UPGRADES = LIBRARY.extended(ORDER_KEY_OF)

# KEYS: the cluster's queue. ARGV: the seconds after its creation a batch without an order key is keyed at.
# Returns how many ids moved from the list to the sorted set, -1 when the queue was not a list (nothing to do).
UPGRADE_QUEUE = UPGRADES.script(
    r"""
if redis.call('TYPE', KEYS[1])['ok'] ~= 'list' then return -1 end
local ids = redis.call('LRANGE', KEYS[1], 0, -1)
redis.call('DEL', KEYS[1])
local seq = redis.call('INCRBY', K_SEQ, #ids) - #ids
local keyed = {}
for i, g in ipairs(ids) do
  local bid = split_gid(g)
  if keyed[bid] == nil then keyed[bid] = order_key_of(bid, tonumber(ARGV[1])) end
  local r = rank(keyed[bid], seq + i)
  redis.call('ZADD', KEYS[1], r, g)
  if redis.call('EXISTS', k_query(g)) == 1 then redis.call('HSET', k_query(g), 'rank', r) end
end
return #ids
"""
)


# KEYS: the intake set. ARGV: as UPGRADE_QUEUE. Gives every batch in background intake its order key.
KEY_INTAKE = UPGRADES.script(
    r"""
for _, bid in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do order_key_of(bid, tonumber(ARGV[1])) end
return 0
"""
)


def upgrade_queues(client: redis.Redis, order: QueueOrder) -> dict[str, int]:
    """Every registered cluster's queue as a sorted set (and every batch in intake keyed); returns how many
    ids each list held (only those upgraded)."""
    after = order.key(0.0)  # the key of a batch created at 0 without a deadline or priority: its offset
    out = {}
    script = client.register_script(UPGRADE_QUEUE)
    for c in sorted(client.smembers(keys.CLUSTERS)):
        n = int(script(keys=[keys.queue(c)], args=[after]))
        if n >= 0:
            out[c] = n
    client.register_script(KEY_INTAKE)(keys=[INTAKE], args=[after])
    return out
