"""Lua scripts that take planned ids out of a cluster's queue: to move them to another cluster's
queue (offloading, evacuation, rebalance) or to fail them (a removed cluster's queries that can
run nowhere else).

They are composed from :data:`workqueue.lua_queue.LIBRARY` (extended with the functions below) and keep the
rules :mod:`workqueue.scripts` lists, plus
``take``: how planned ids are found (among the last ``window`` entries: O(log n) an id) and removed, and
``land``: how moved ids arrive on the destination (each at its own rank: a moved query keeps its place
in the order, :mod:`workqueue.ordering`; the ``pending`` counters, the batch's tokens left by cluster and
the clusters' move statistics: a row leaves its source at its charge there and is charged its full size,
:data:`workqueue.keys.FULL_TOKENS`, on the destination, whose prefix cache does not hold its prompt), the same
for every kind of move.
"""

from __future__ import annotations

from workqueue.lua_queue import LIBRARY

MOVE_FUNCTIONS = r"""
-- Put ids (listed back of src first) in dst's queue KEYS[2], each at its own rank (its place in the order).
-- Each leaves src at its charge there (`tokens`: less the prefix src's cache held) and is charged its full size
-- on dst (F_FULL_TOKENS, which becomes its `tokens`: dst's cache does not hold its prefix; a row without the
-- field keeps its `tokens`): in KEYS[3] and KEYS[4], the batch's tokens left by cluster and the clusters'
-- assigned tokens. Returns the tokens charged on dst.
local function land(moved, src, dst)
  local out, into = 0, 0
  for i = #moved, 1, -1 do
    local g = moved[i]
    local h = redis.call('HMGET', k_query(g), 'tokens', 'rank', F_FULL_TOKENS)
    local t = tonumber(h[1] or '0')
    local full = math.max(t, tonumber(h[3] or '') or t)
    out, into = out + t, into + full
    redis.call('HSET', k_query(g), 'cluster', dst, 'tokens', full)
    redis.call('ZADD', KEYS[2], tonumber(h[2] or '0'), g)
    local b = k_batch(split_gid(g))
    if redis.call('EXISTS', b) == 1 then
      redis.call('HINCRBYFLOAT', b, 'left:' .. src, -t)
      redis.call('HINCRBYFLOAT', b, 'left:' .. dst, full)
    end
    redis.call('HINCRBYFLOAT', k_cluster_stats(src), 'assigned_predicted_tokens', -t)
    redis.call('HINCRBYFLOAT', k_cluster_stats(dst), 'assigned_predicted_tokens', full)
    redis.call('HINCRBY', k_cluster_stats(src), 'moved_out', 1)
    redis.call('HINCRBY', k_cluster_stats(dst), 'moved_in', 1)
  end
  redis.call('INCRBYFLOAT', KEYS[3], -out)
  redis.call('INCRBYFLOAT', KEYS[4], into)
  return into
end

-- Take the ids of the set `want` out of `queue` that stand among its last `window` entries (a mover plans from a
-- read of the back, and ids that moved forward since stay for a later round): ZREVRANK then ZREM, O(log n) an id.
-- Returns those that have a query hash, back of the queue first.
local function take(queue, window, want, left)
  local found = {}
  for g in pairs(want) do
    local r = redis.call('ZREVRANK', queue, g)
    if r and r < window then found[#found + 1] = {r, g} end
  end
  table.sort(found, function(a, b) return a[1] < b[1] end)
  local out = {}
  for _, e in ipairs(found) do
    redis.call('ZREM', queue, e[2])
    if redis.call('EXISTS', k_query(e[2])) == 1 then out[#out + 1] = e[2] end
  end
  return out
end
"""
MOVES = LIBRARY.extended(MOVE_FUNCTIONS)

# KEYS: queue of src, queue of dst, pending of src, pending of dst. ARGV: src, dst, n. Moves up to n queries from the back of src's
# queue (those that would run last) to dst's, each at its rank; ids without a query hash are dropped on the way.
# Returns {moved, tokens charged on dst}.
MOVE_TAIL = MOVES.script(
    r"""
local n, moved = tonumber(ARGV[3]), {}
while #moved < n do
  local g = redis.call('ZPOPMAX', KEYS[1])[1]
  if not g then break end
  if redis.call('EXISTS', k_query(g)) == 1 then moved[#moved + 1] = g end
end
return {#moved, tostring(land(moved, ARGV[1], ARGV[2]))}
"""
)

# KEYS: as MOVE_TAIL. ARGV: src, dst, window, gid... Moves exactly those ids still queued on src among its last `window`
# entries to dst, each at its rank. Cost: O(log n) an id.
MOVE_IDS = MOVES.script(
    r"""
local want, left = {}, 0
for i = 4, #ARGV do if not want[ARGV[i]] then want[ARGV[i]] = true; left = left + 1 end end
local found = take(KEYS[1], tonumber(ARGV[3]), want, left)
return {#found, tostring(land(found, ARGV[1], ARGV[2]))}
"""
)

# KEYS: queue, pending of the cluster. ARGV: cluster, window, now, then gid, result JSON pairs. Those ids still
# queued on the cluster (looked for as MOVE_IDS does) leave its queue and its pending counter and are finished as
# failed with their result (write-once: ``finish``). Returns how many were failed.
FAIL_IDS = MOVES.script(
    r"""
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
