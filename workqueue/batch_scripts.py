"""Lua scripts of a batch's life beyond its queries' claims: cancel, expiry at the deadline, the sweep
that finishes a stopping batch's queued queries, and the landing of a background-intake chunk.

They are composed from :data:`workqueue.lua_queue.LIBRARY` and keep the rules :mod:`workqueue.scripts` lists, plus:

* **A stopping batch** is ``cancelling`` (its owner cancelled it) or ``expiring`` (its
  deadline passed): O(1) to mark, whatever the queues hold. Its queued queries are finished by
  the bounded sweep or by the claim that reaches them, its running ones aborted by their
  workers; finished rows are kept. Each ends ``cancelled`` (kind), with ``finish_reason``
  ``cancelled`` or ``batch_expired``, and the batch ``cancelled`` or ``expired``.
* **Deadlines** are on the gateway's clock, like every record time: ``{fb}:deadlines``
  holds the unfinished batches that have one, scored by it.
"""

from __future__ import annotations

from workqueue.lua_queue import LIBRARY

# KEYS: the batch's hash. ARGV: batch id, now. Marks the batch cancelling: O(1), whatever the queues hold. Its queued
# queries are then cancelled by SWEEP_CANCELLED (bounded chunks) or when a CLAIM reaches them;
# running ones are aborted by their workers. Returns -1 (unknown batch), 0 (already final) or 1.
CANCEL = LIBRARY.script(
    r"""
local bid, now = ARGV[1], ARGV[2]
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return -1 end
if status == 'completed' or status == 'failed' or status == 'cancelled' or status == 'expired' then return 0 end
if status == 'expiring' then return 0 end  -- its window ended first: it ends expired
stop(bid, 'cancelling', now)
return 1
"""
)

# KEYS: the deadlines set. ARGV: now (the gateway's clock, the clock deadlines are set on), n. Marks up to n batches whose
# deadline passed expiring (ZSET {fb}:deadlines, scored by deadline): like a cancel, O(1) each; their queued queries
# are then finished as batch_expired by SWEEP_CANCELLED or the CLAIM that reaches them, running ones are aborted by
# their workers and recorded expired, finished ones are kept. A batch being cancelled stays cancelled. Returns the ids.
EXPIRE_DUE = LIBRARY.script(
    r"""
local now = ARGV[1]
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[2]))
local out = {}
for _, bid in ipairs(due) do
  local status = redis.call('HGET', k_batch(bid), 'status')
  if status == 'in_progress' or status == 'validating' then
    stop(bid, 'expiring', now)
    out[#out + 1] = bid
  else
    redis.call('ZREM', K_DEADLINES, bid)
  end
end
return out
"""
)

# KEYS: queue, pending of the cluster. ARGV: cluster, start, count, now. Looks at most `count` queued ids of the cluster's queue
# from index `start` (in queue order) and finishes those whose batch is stopping (cancelled, or expired:
# stop_reason()): each leaves the queue (ZREM), so one call costs O(count log n), never a scan of a whole
# million-query queue per id. Ids without a query hash are dropped without recreating one.
# Returns {finished, looked at, next start}.
SWEEP_CANCELLED = LIBRARY.script(
    r"""
local c, start, count, now = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
local ids = redis.call('ZRANGE', KEYS[1], start, start + count - 1)
local reasons = {}
local n, removed, tokens = 0, 0, 0
for i, g in ipairs(ids) do
  local bid = split_gid(g)
  if reasons[bid] == nil then reasons[bid] = stop_reason(redis.call('HGET', k_batch(bid), 'status')) or false end
  local why = reasons[bid]
  if why then
    redis.call('ZREM', KEYS[1], g)
    removed = removed + 1
    if redis.call('EXISTS', k_query(g)) == 1 then  -- never recreate a query hash
      tokens = tokens + tonumber(redis.call('HGET', k_query(g), 'tokens') or '0')
      redis.call('HSET', k_query(g), 'state', 'cancelling')
      if finish(g, stopped_result(g, c, why), 'cancelled', 0, now) >= 0 then n = n + 1 end
    end
  end
end
if removed > 0 then redis.call('INCRBYFLOAT', KEYS[2], -tokens) end
return {n, #ids, start + #ids - removed}
"""
)

# KEYS: the batch's hash, its intake lease, its intake list, the intake set, the clusters set (and, built here, the
# sequence {fb}:seq and the deadlines set, all under the {fb} tag). ARGV: batch id, lease token,
# cursor (rows of the batch enqueued before this chunk), now, lease ms, then four per row of the chunk:
# gid, payload JSON, predicted tokens (its charge: less its prefix discount), cluster (cluster '': the row fails at
# once, its payload being its result JSON). A queued row's hash keeps its charge as ``tokens`` and its full size
# (prompt + predicted response, read from its payload) as keys.FULL_TOKENS. One chunk of a batch accepted by the
# background intake lands atomically: only while the caller holds the batch's intake lease (which the call extends) and the batch's
# ``intake_done`` still equals the cursor, so a chunk is never enqueued twice. The chunk's rows
# leave the head of the intake list; each is queued on its cluster, or (batch cancelling) finished
# as cancelled. The first chunk turns a ``validating`` batch ``in_progress``; the last one takes
# the batch out of the intake set. Returns rows handled, or -1 (lease lost), -2 (no batch),
# -3 (cursor moved on: another replica enqueued it).
ENQUEUE_CHUNK = LIBRARY.script(
    r"""
-- A queued row's full size (prompt + predicted response, no prefix discount) from its payload JSON, never below its
-- charge `tokens` (its fallback). The payload (gateway.intake.rows.payload) has "prompt_tokens" and "predicted_tokens"
-- after the ids and the prompt, whose quotes are escaped: a plain find of the first key (memchr-fast, where decoding
-- the payload added 8 to 24 ms to a call of 1,000 rows) is the field's; any other layout is decoded.
local function full_size(payload, tokens)
  local at = string.find(payload, '"prompt_tokens": ', 1, true)
  local a, b = nil, nil
  if at then a, b = string.match(payload, '^([%d.eE+-]+), "predicted_tokens": ([%d.eE+-]+)', at + 17) end
  if not (tonumber(a) and tonumber(b)) then
    local ok, p = pcall(cjson.decode, payload)
    if not ok or type(p) ~= 'table' then return tokens end
    a, b = p.prompt_tokens, p.predicted_tokens
  end
  local s = (tonumber(a) or 0) + (tonumber(b) or 0)
  if s > tokens then return s end
  return tokens
end
local bid, token, cursor, now, lease_ms = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4], tonumber(ARGV[5])
if not lease_held(KEYS[2], token) then return -1 end
local b = KEYS[1]
local h = redis.call('HMGET', b, 'status', 'intake_done', 'intake_total', 'queries_per_cluster',
                     'predicted_tokens_per_cluster', 'order_key')
if not h[1] then return -2 end
if tonumber(h[2] or '-1') ~= cursor then return -3 end
local n = (#ARGV - 5) / 4
local why = stop_reason(h[1])
local order_key = tonumber(h[6] or '0')
local seq = redis.call('INCRBY', K_SEQ, n) - n
local per_q = cjson.decode(h[4] or '{}')
local per_t = cjson.decode(h[5] or '{}')
local touched = {}
local total = tonumber(h[3] or '0')
local done_after = cursor + n
-- counters first: finish() below may finalize the batch and must see every row as enqueued
redis.call('HSET', b, 'intake_done', done_after)
if done_after >= total then
  redis.call('ZREM', KEYS[4], bid)
  redis.call('DEL', KEYS[3])
else
  redis.call('LTRIM', KEYS[3], n, -1)
end
for i = 0, n - 1 do
  local g, payload, tokens, c = ARGV[6 + 4 * i], ARGV[7 + 4 * i], tonumber(ARGV[8 + 4 * i]), ARGV[9 + 4 * i]
  if why then
    finish(g, stopped_result(g, c, why), 'cancelled', 0, now)
  elseif c == '' then
    finish(g, payload, 'failed', 0, now)
  else
    local r = rank(order_key, seq + i)
    redis.call('HSET', k_query(g), 'payload', payload, 'tokens', tokens, F_FULL_TOKENS, full_size(payload, tokens),
               'cluster', c, 'state', 'queued', 'attempts', 0, 'enqueued_at', now, 'rank', r)
    redis.call('ZADD', k_queue(c), r, g)
    per_q[c] = (per_q[c] or 0) + 1
    per_t[c] = (per_t[c] or 0) + tokens
    if not touched[c] then touched[c] = {0, 0} end
    touched[c][1] = touched[c][1] + 1
    touched[c][2] = touched[c][2] + tokens
  end
end
for c, t in pairs(touched) do
  redis.call('HINCRBYFLOAT', b, 'left:' .. c, t[2])
  redis.call('SADD', KEYS[5], c)
  redis.call('HSETNX', k_cluster_info(c), 'state', 'active')
  redis.call('INCRBYFLOAT', k_pending(c), t[2])
  redis.call('HINCRBYFLOAT', k_cluster_stats(c), 'assigned_predicted_tokens', t[2])
  redis.call('HINCRBY', k_cluster_stats(c), 'assigned_queries', t[1])
end
if next(touched) ~= nil then
  redis.call('HSET', b, 'queries_per_cluster', cjson.encode(per_q), 'predicted_tokens_per_cluster', cjson.encode(per_t))
end
if redis.call('HGET', b, 'status') == 'validating' then redis.call('HSET', b, 'status', 'in_progress') end
lease_renew(KEYS[2], token, lease_ms)
return n
"""
)
