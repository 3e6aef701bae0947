"""Lua scripts: every change that touches several keys runs atomically inside Redis.

Key names come from :mod:`workqueue.keys`: each script is called with the keys it knows up
front as ``KEYS`` (documented above it), and builds the ones it meets on the way (a popped
id's query hash, its batch) with Lua functions generated from the same templates. All keys
share the ``{fb}`` hash tag, so the scripts run unchanged on a Redis Cluster.

Rules the scripts keep:

* **Lease time is Redis time.** CLAIM, RENEW and REQUEUE_EXPIRED read the server clock
  (``TIME``) for lease deadlines and for the expiry check, so clients whose clocks are
  skewed neither expire live leases nor keep dead ones. Scripts replicate as effects
  (``redis.replicate_commands()``: the default since Redis 5, a no-op in Redis 7), which
  lets them call ``TIME`` before writing. Timestamps that only end up in records
  (``enqueued_at``, ``started_at``, ``completed_at``) come from the caller.
* **Renewals go with the claim.** CLAIM (and RENEW with a worker id) renews a worker's leases and
  takes back its queries requeued meanwhile: a worker is never handed a query it already runs.
  A cluster marked ``removed`` claims nothing new from the moment it is marked (its queue is
  the movers' to empty), whenever its worker next looks at the cluster's state.
* **A late completion reconciles.** ``finish`` may run for a query that REQUEUE_EXPIRED
  already put back (its worker was slow, not dead): the query's state is then ``queued``,
  and ``finish`` takes its id out of the queue that holds it and its tokens out of that
  cluster's ``pending`` counter, so nothing runs it again and the counter stays exact.
* **Ids without a query hash are dropped.** CLAIM and the moves (:mod:`workqueue.move_scripts`) skip an id whose hash is
  gone (a query finished while queued, under older code) and never recreate the hash.
* **Finished batches expire.** When a batch reaches a final state, its hash, results and
  done set get a TTL of the batch's ``retention_s`` (set at creation; 0 keeps them forever).
  A late completion for a batch that already expired records nothing.
* **Poison queries fail at their next claim.** REQUEUE_EXPIRED puts every lapsed query back;
  CLAIM gives up on a popped query that already used its ``max_attempts`` claims: it is
  finished as ``failed`` (``finish_reason`` ``error``) and the rest of its batch goes on.
  Until then its live owner (an outage outlasted its lease) can still take it back.
"""

from __future__ import annotations

from workqueue import keys

PRELUDE = (
    """
redis.replicate_commands()
"""
    + keys.lua_functions()
    + r"""
local function split_gid(g)
  local i = string.find(g, ':', 1, true)
  return string.sub(g, 1, i - 1), string.sub(g, i + 1)
end
-- The Redis server's clock, in seconds: the only clock lease deadlines are measured on.
local function server_now()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end

-- A batch that reached a final state keeps its keys for its retention_s (0: forever).
local function retire(bid)
  local keep = tonumber(redis.call('HGET', k_batch(bid), 'retention_s') or '0')
  if keep and keep > 0 then
    redis.call('EXPIRE', k_batch(bid), keep)
    redis.call('EXPIRE', k_results(bid), keep)
    redis.call('EXPIRE', k_done(bid), keep)
  end
end

-- A batch whose every query is counted finished takes its final status (and starts its retention).
local function settle(bid, now)
  local b = k_batch(bid)
  local h = redis.call('HMGET', b, 'total', 'completed', 'failed', 'cancelled', 'status')
  local finished = tonumber(h[2] or '0') + tonumber(h[3] or '0') + tonumber(h[4] or '0')
  if finished >= tonumber(h[1] or '0') then
    local status = 'completed'
    if h[5] == 'cancelling' or h[5] == 'cancelled' then
      status = 'cancelled'
    elseif tonumber(h[2] or '0') == 0 and tonumber(h[3] or '0') > 0 then
      status = 'failed'
    end
    redis.call('HSET', b, 'status', status, 'completed_at', now)
    retire(bid)
  end
end

-- Record the final result of one query once; returns its index in the result list, or -1
-- when the query already had a result (results are write-once per query id).
-- A query still marked queued was requeued after its lease lapsed and is finished late by
-- its old worker: its id leaves the queue holding it, and its tokens that queue's counter.
local function finish(g, result, kind, actual, now)
  local bid, qid = split_gid(g)
  if redis.call('HEXISTS', k_batch(bid), 'status') == 0 then  -- its batch expired: nothing to record
    redis.call('DEL', k_query(g))
    return -1
  end
  if redis.call('SADD', k_done(bid), qid) == 0 then return -1 end
  local q = k_query(g)
  local h = redis.call('HMGET', q, 'cluster', 'tokens', 'state')
  local cluster, tokens, state = h[1], tonumber(h[2] or '0'), h[3]
  local idx = redis.call('RPUSH', k_results(bid), result) - 1
  local b = k_batch(bid)
  redis.call('HINCRBY', b, kind, 1)
  if cluster then
    redis.call('ZREM', k_inflight(cluster), g)
    if state == 'queued' and redis.call('LREM', k_queue(cluster), 1, g) > 0 then
      redis.call('INCRBYFLOAT', k_pending(cluster), -tokens)
    end
    if kind == 'completed' then
      redis.call('HINCRBYFLOAT', k_cluster_stats(cluster), 'finished_predicted_tokens', tokens)
      redis.call('HINCRBY', k_cluster_stats(cluster), 'finished_actual_tokens', actual)
      redis.call('HINCRBY', k_cluster_stats(cluster), 'finished_queries', 1)
    end
  end
  redis.call('DEL', q)
  settle(bid, now)
  return idx
end

-- A worker renews the queries it runs (ARGV[from..]) on cluster c: its leases move to deadline, and
-- those REQUEUE_EXPIRED put back in c's queue come back to it (out of the queue and pending, no new
-- attempt). Others' queries are left alone. Returns how many it renewed or took back.
local function reassert(c, worker, deadline, inflight, queue, pending, from)
  local n = 0
  for i = from, #ARGV do
    local g = ARGV[i]
    local q = k_query(g)
    local h = redis.call('HMGET', q, 'state', 'worker', 'cluster', 'tokens')
    if h[2] == worker and h[3] == c then
      if h[1] == 'running' then
        n = n + redis.call('ZADD', inflight, 'XX', 'CH', deadline, g)
      elseif h[1] == 'queued' and redis.call('LREM', queue, 1, g) > 0 then
        redis.call('INCRBYFLOAT', pending, -tonumber(h[4] or '0'))
        redis.call('HSET', q, 'state', 'running')
        redis.call('ZADD', inflight, deadline, g)
        n = n + 1
      end
    end
  end
  return n
end

local function cancelled_result(g, cluster)
  local bid, qid = split_gid(g)
  return '{"batch_id":' .. cjson.encode(bid) .. ',"query_id":' .. cjson.encode(qid) ..
         ',"cluster":' .. cjson.encode(cluster or '') .. ',"finish_reason":"cancelled"}'
end

local function gave_up_result(g, cluster, attempts, max_attempts)
  local bid, qid = split_gid(g)
  local times = ' times'
  if attempts == 1 then times = ' time' end
  local why = 'failed ' .. attempts .. times .. ' (max_attempts ' .. max_attempts ..
              '): its worker died or lost its lease each time'
  return '{"batch_id":' .. cjson.encode(bid) .. ',"query_id":' .. cjson.encode(qid) ..
         ',"cluster":' .. cjson.encode(cluster or '') .. ',"finish_reason":"error","error":' ..
         cjson.encode(why) .. ',"attempts":' .. attempts .. '}'
end
"""
)

# KEYS: the query's hash, its batch's hash. ARGV: gid, result JSON, kind (completed|failed|cancelled), actual tokens, now
COMPLETE = (
    PRELUDE
    + r"""
return finish(ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5])
"""
)

# KEYS: queue, inflight, pending of the cluster. ARGV: cluster, n, lease seconds, worker id, now (caller's clock: timestamps only),
# max attempts (0: no limit), then the gids the worker runs, renewed first (``reassert``). Leases end at Redis time +
# lease seconds. A popped query that already had max attempts claims is finished as failed (it gave up), not handed out.
# Returns a flat list: how many gave up, then gid, payload, attempts, enqueued_at, ... for each newly claimed query.
CLAIM = (
    PRELUDE
    + r"""
local c, n, worker, now, max_attempts = ARGV[1], tonumber(ARGV[2]), ARGV[4], ARGV[5], tonumber(ARGV[6])
local deadline = server_now() + tonumber(ARGV[3])
reassert(c, worker, deadline, KEYS[2], KEYS[1], KEYS[3], 7)
local out = {0}
local taken, gave_up = 0, 0
if redis.call('HGET', k_cluster_info(c), 'state') == 'removed' then n = 0 end  -- a removed cluster takes nothing new
while taken < n do
  local g = redis.call('LPOP', KEYS[1])
  if not g then break end
  local q = k_query(g)
  local fields = redis.call('HMGET', q, 'payload', 'tokens', 'enqueued_at', 'attempts')
  if fields[1] then
    redis.call('INCRBYFLOAT', KEYS[3], -tonumber(fields[2] or '0'))
    local bid = split_gid(g)
    local status = redis.call('HGET', k_batch(bid), 'status')
    local used = tonumber(fields[4] or '0')
    if status == 'cancelling' or status == 'cancelled' then
      redis.call('HSET', q, 'state', 'cancelling')  -- already popped: finish() must not scan the queue for it
      finish(g, cancelled_result(g, c), 'cancelled', 0, now)
    elseif max_attempts > 0 and used >= max_attempts then
      redis.call('HSET', q, 'state', 'failing')  -- already popped: finish() must not scan the queue for it
      finish(g, gave_up_result(g, c, used, max_attempts), 'failed', 0, now)
      gave_up = gave_up + 1
    else
      local attempts = redis.call('HINCRBY', q, 'attempts', 1)
      redis.call('HSET', q, 'state', 'running', 'worker', worker, 'started_at', now, 'cluster', c)
      redis.call('ZADD', KEYS[2], deadline, g)
      out[#out + 1] = g
      out[#out + 1] = fields[1]
      out[#out + 1] = tostring(attempts)
      out[#out + 1] = fields[3] or '0'
      taken = taken + 1
    end
  end
end
out[1] = gave_up
return out
"""
)

# KEYS: inflight, queue, pending of the cluster. ARGV: cluster, lease seconds, worker id ('': any), gid...
# Leases to Redis time + lease seconds: with a worker id by ``reassert``, else those still in flight.
RENEW = (
    PRELUDE
    + r"""
local c, worker = ARGV[1], ARGV[3]
local deadline = server_now() + tonumber(ARGV[2])
if worker ~= '' then return reassert(c, worker, deadline, KEYS[1], KEYS[2], KEYS[3], 4) end
local n = 0
for i = 4, #ARGV do
  n = n + redis.call('ZADD', KEYS[1], 'XX', 'CH', deadline, ARGV[i])
end
return n
"""
)

# Lua: requeue_lapsed(c, inflight, queue, pending, now) puts cluster c's queries whose lease lapsed
# by ``now`` back at the head of its queue; returns how many (REQUEUE_EXPIRED, and REQUEUE_ALL
# of workqueue.ticks for every cluster at once).
REQUEUE_LAPSED = r"""
local function requeue_lapsed(c, inflight, queue, pending, now)
  local expired = redis.call('ZRANGEBYSCORE', inflight, '-inf', now)
  local n = 0
  for i = #expired, 1, -1 do
    local g = expired[i]
    redis.call('ZREM', inflight, g)
    local q = k_query(g)
    local h = redis.call('HMGET', q, 'state', 'tokens')
    if h[1] == 'running' then
      redis.call('HSET', q, 'state', 'queued', 'cluster', c)
      redis.call('LPUSH', queue, g)
      redis.call('INCRBYFLOAT', pending, tonumber(h[2] or '0'))
      n = n + 1
    end
  end
  return n
end
"""

# KEYS: inflight, queue, pending of the cluster. ARGV: cluster. Leases past their deadline (in Redis time) go back
# to the head of the queue (a query that used its max attempts fails at its next CLAIM, unless its owner takes it
# back first). Returns how many were requeued.
REQUEUE_EXPIRED = (
    PRELUDE
    + REQUEUE_LAPSED
    + r"""
return requeue_lapsed(ARGV[1], KEYS[1], KEYS[2], KEYS[3], server_now())
"""
)

# KEYS: the batch's hash. ARGV: batch id, now. Marks the batch cancelling: O(1), whatever the queues hold. Its queued
# queries are then cancelled by SWEEP_CANCELLED (bounded chunks) or when a CLAIM reaches them;
# running ones are aborted by their workers. Returns -1 (unknown batch), 0 (already final) or 1.
CANCEL = (
    PRELUDE
    + r"""
local bid, now = ARGV[1], ARGV[2]
local b = KEYS[1]
local status = redis.call('HGET', b, 'status')
if not status then return -1 end
if status == 'completed' or status == 'failed' or status == 'cancelled' then return 0 end
redis.call('HSET', b, 'status', 'cancelling')
local h = redis.call('HMGET', b, 'total', 'completed', 'failed', 'cancelled')
if tonumber(h[2] or '0') + tonumber(h[3] or '0') + tonumber(h[4] or '0') >= tonumber(h[1] or '0') then
  redis.call('HSET', b, 'status', 'cancelled', 'completed_at', now)
  retire(bid)
end
return 1
"""
)

# KEYS: queue, pending of the cluster. ARGV: cluster, start, count, now. Looks at most `count` queued ids of the cluster's queue
# from index `start` and cancels those whose batch is cancelling: their slots are overwritten
# with a tombstone (LSET) and removed in one LREM that stops at the last of them, so one call
# costs O(start + count), never a scan of a whole million-query queue per id.
# Ids without a query hash are dropped without recreating one. Returns {cancelled, looked at, next start}.
SWEEP_CANCELLED = (
    PRELUDE
    + r"""
local c, start, count, now = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
local TOMB = '\0cancelled'
local ids = redis.call('LRANGE', KEYS[1], start, start + count - 1)
local statuses = {}
local n, removed, tokens = 0, 0, 0
for i, g in ipairs(ids) do
  local bid = split_gid(g)
  if statuses[bid] == nil then statuses[bid] = redis.call('HGET', k_batch(bid), 'status') or '' end
  if statuses[bid] == 'cancelling' or statuses[bid] == 'cancelled' then
    redis.call('LSET', KEYS[1], start + i - 1, TOMB)
    removed = removed + 1
    if redis.call('EXISTS', k_query(g)) == 1 then  -- never recreate a query hash
      tokens = tokens + tonumber(redis.call('HGET', k_query(g), 'tokens') or '0')
      redis.call('HSET', k_query(g), 'state', 'cancelling')
      if finish(g, cancelled_result(g, c), 'cancelled', 0, now) >= 0 then n = n + 1 end
    end
  end
end
if removed > 0 then
  redis.call('LREM', KEYS[1], removed, TOMB)
  redis.call('INCRBYFLOAT', KEYS[2], -tokens)
end
return {n, #ids, start + #ids - removed}
"""
)

# KEYS: the batch's hash, its intake lease, its intake list, the intake set, the clusters set. ARGV: batch id, lease token,
# cursor (rows of the batch enqueued before this chunk), now, lease ms, then four per row of the chunk:
# gid, payload JSON, predicted tokens, cluster (cluster '': the row fails at once, its payload being
# its result JSON). One chunk of a batch accepted by the background intake lands atomically: only
# while the caller holds the batch's intake lease (which the call extends) and the batch's
# ``intake_done`` still equals the cursor, so a chunk is never enqueued twice. The chunk's rows
# leave the head of the intake list; each is queued on its cluster, or (batch cancelling) finished
# as cancelled. The first chunk turns a ``validating`` batch ``in_progress``; the last one takes
# the batch out of the intake set. Returns rows handled, or -1 (lease lost), -2 (no batch),
# -3 (cursor moved on: another replica enqueued it).
ENQUEUE_CHUNK = (
    PRELUDE
    + r"""
local bid, token, cursor, now, lease_ms = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4], tonumber(ARGV[5])
if redis.call('GET', KEYS[2]) ~= token then return -1 end
local b = KEYS[1]
local h = redis.call('HMGET', b, 'status', 'intake_done', 'intake_total', 'queries_per_cluster',
                     'predicted_tokens_per_cluster')
if not h[1] then return -2 end
if tonumber(h[2] or '-1') ~= cursor then return -3 end
local n = (#ARGV - 5) / 4
local cancelled = h[1] == 'cancelling' or h[1] == 'cancelled'
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
  if cancelled then
    finish(g, cancelled_result(g, c), 'cancelled', 0, now)
  elseif c == '' then
    finish(g, payload, 'failed', 0, now)
  else
    redis.call('HSET', k_query(g), 'payload', payload, 'tokens', tokens, 'cluster', c, 'state', 'queued',
               'attempts', 0, 'enqueued_at', now)
    redis.call('RPUSH', k_queue(c), g)
    per_q[c] = (per_q[c] or 0) + 1
    per_t[c] = (per_t[c] or 0) + tokens
    if not touched[c] then touched[c] = {0, 0} end
    touched[c][1] = touched[c][1] + 1
    touched[c][2] = touched[c][2] + tokens
  end
end
for c, t in pairs(touched) do
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
redis.call('PEXPIRE', KEYS[2], lease_ms)
return n
"""
)
