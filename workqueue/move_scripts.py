"""Lua scripts that take planned ids out of a cluster's queue: to move them to another cluster's
queue (offloading, evacuation, rebalance) or to fail them (a removed cluster's queries that can
run nowhere else).

They share :data:`workqueue.scripts.PRELUDE` and the rules :mod:`workqueue.scripts` lists, plus
``take``: how planned ids are found (from the back, in pages, within a window) and removed, and
``land``: how moved ids arrive on the destination (its queue tail, the ``pending`` counters and
the clusters' move statistics), the same for every kind of move.
"""

from __future__ import annotations

from workqueue.scripts import PRELUDE

MOVE_PRELUDE = (
    PRELUDE
    + r"""
-- Append ids (listed back of src first) to dst's queue KEYS[2] in src order, tokens from KEYS[3] to KEYS[4].
local function land(moved, src, dst)
  local tokens = 0
  for i = #moved, 1, -1 do
    local g = moved[i]
    local t = tonumber(redis.call('HGET', k_query(g), 'tokens') or '0')
    tokens = tokens + t
    redis.call('HSET', k_query(g), 'cluster', dst)
    redis.call('RPUSH', KEYS[2], g)
    redis.call('HINCRBYFLOAT', k_cluster_stats(src), 'assigned_predicted_tokens', -t)
    redis.call('HINCRBYFLOAT', k_cluster_stats(dst), 'assigned_predicted_tokens', t)
    redis.call('HINCRBY', k_cluster_stats(src), 'moved_out', 1)
    redis.call('HINCRBY', k_cluster_stats(dst), 'moved_in', 1)
  end
  redis.call('INCRBYFLOAT', KEYS[3], -tokens)
  redis.call('INCRBYFLOAT', KEYS[4], tokens)
  return tokens
end

-- Take the ids of the set `want` (`left` of them) out of `queue`, looked for from the back, in pages, until all
-- are found or `window` entries were seen: their slots become tombstones that one LREM from the tail removes.
-- Cost: O(how far from the back the farthest one stands). Returns those with a query hash, back first.
local function take(queue, window, want, left)
  local TOMB, found, removed, seen = '\0taking', {}, 0, 0
  window = math.min(window, redis.call('LLEN', queue))
  while left > 0 and seen < window do
    local page = math.min(1000, window - seen)
    local ids = redis.call('LRANGE', queue, -(seen + page), -(seen + 1))
    for i = #ids, 1, -1 do
      local g = ids[i]
      if want[g] then
        want[g], left, removed = nil, left - 1, removed + 1
        redis.call('LSET', queue, -(seen + #ids - i + 1), TOMB)
        if redis.call('EXISTS', k_query(g)) == 1 then found[#found + 1] = g end
      end
    end
    seen = seen + page
  end
  if removed > 0 then redis.call('LREM', queue, -removed, TOMB) end
  return found
end
"""
)

# KEYS: queue of src, queue of dst, pending of src, pending of dst. ARGV: src, dst, n. Moves up to n queries from the tail of src's queue to the tail of
# dst's, keeping their order; ids without a query hash are dropped on the way.
# Returns {moved, predicted tokens moved}.
MOVE_TAIL = (
    MOVE_PRELUDE
    + r"""
local n, moved = tonumber(ARGV[3]), {}
while #moved < n do
  local g = redis.call('RPOP', KEYS[1])
  if not g then break end
  if redis.call('EXISTS', k_query(g)) == 1 then moved[#moved + 1] = g end
end
return {#moved, tostring(land(moved, ARGV[1], ARGV[2]))}
"""
)

# KEYS: as MOVE_TAIL. ARGV: src, dst, window, gid... Moves exactly those ids still queued on src (looked for from the
# back, in pages, until all are found or `window` entries were seen) to dst's tail, in their order on src: their slots
# become tombstones that one LREM from the tail removes. Cost: O(how far from the back the farthest one stands).
MOVE_IDS = (
    MOVE_PRELUDE
    + r"""
local want, left = {}, 0
for i = 4, #ARGV do if not want[ARGV[i]] then want[ARGV[i]] = true; left = left + 1 end end
local found = take(KEYS[1], tonumber(ARGV[3]), want, left)
return {#found, tostring(land(found, ARGV[1], ARGV[2]))}
"""
)

# KEYS: queue, pending of the cluster. ARGV: cluster, window, now, then gid, result JSON pairs. Those ids still
# queued on the cluster (looked for as MOVE_IDS does) leave its queue and its pending counter and are finished as
# failed with their result (write-once: ``finish``). Returns how many were failed.
FAIL_IDS = (
    MOVE_PRELUDE
    + r"""
local now, rows, want, left = ARGV[3], {}, {}, 0
for i = 4, #ARGV - 1, 2 do
  if not want[ARGV[i]] then want[ARGV[i]], rows[ARGV[i]], left = true, ARGV[i + 1], left + 1 end
end
local n, tokens = 0, 0
for _, g in ipairs(take(KEYS[1], tonumber(ARGV[2]), want, left)) do
  local q = k_query(g)
  tokens = tokens + tonumber(redis.call('HGET', q, 'tokens') or '0')
  redis.call('HSET', q, 'state', 'failing')  -- out of the queue already: finish() must not scan it
  if finish(g, rows[g], 'failed', 0, now) >= 0 then n = n + 1 end
end
redis.call('INCRBYFLOAT', KEYS[2], -tokens)
return n
"""
)
