"""The queue's shared Lua functions, and the library every queue script is composed from (:mod:`workqueue.lua`).

:data:`LIBRARY` holds, in this order: the key builders (:func:`workqueue.keys.lua_functions`), ``rank``
(:func:`workqueue.ordering.lua_rank`), the lease's functions (:data:`workqueue.lease.LUA`), then the queue's
own below (the rules they keep are listed in :mod:`workqueue.scripts`). A script is
``LIBRARY.script(body)``: the body with only the functions it uses in front.
"""

from __future__ import annotations

import json

from workqueue import keys, lease, ordering
from workqueue.lua import Library

#: the error an expired row's result carries (finish_reason ``batch_expired``)
EXPIRED_ERROR = "the batch's completion window ended before this request finished"

# Scripts replicate as effects, so they may read TIME before writing (the default since Redis 5, a no-op in Redis 7).
HEADER = "redis.replicate_commands()\n"

QUEUE_FUNCTIONS = (
    f"local EXPIRED_ERROR = {json.dumps(EXPIRED_ERROR)}\n"
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

-- Why the queries of a batch with this status stop: 'cancelled' (cancelling, cancelled), 'batch_expired'
-- (expiring, expired), or nil (they run).
local function stop_reason(status)
  if status == 'cancelling' or status == 'cancelled' then return 'cancelled' end
  if status == 'expiring' or status == 'expired' then return 'batch_expired' end
  return nil
end

-- A batch whose every query is counted finished takes its final status (and starts its retention). An expiring
-- batch ends expired only when its expiry stopped a row: one whose rows all finished anyway (its last ones ran
-- past the deadline) ends as if it had not expired.
local function settle(bid, now)
  local b = k_batch(bid)
  local h = redis.call('HMGET', b, 'total', 'completed', 'failed', 'cancelled', 'status')
  local finished = tonumber(h[2] or '0') + tonumber(h[3] or '0') + tonumber(h[4] or '0')
  if finished >= tonumber(h[1] or '0') then
    local status = 'completed'
    local why = stop_reason(h[5])
    if why == 'cancelled' then
      status = 'cancelled'
    elseif why == 'batch_expired' and tonumber(h[4] or '0') > 0 then
      status = 'expired'
    elseif tonumber(h[2] or '0') == 0 and tonumber(h[3] or '0') > 0 then
      status = 'failed'
    end
    redis.call('HSET', b, 'status', status, 'completed_at', now)
    redis.call('ZREM', K_DEADLINES, bid)
    retire(bid)
  end
end

-- Mark a batch stopping ('cancelling' or 'expiring'); final at once when nothing of it is left to finish.
local function stop(bid, how, now)
  local b = k_batch(bid)
  redis.call('HSET', b, 'status', how)
  redis.call('ZREM', K_DEADLINES, bid)
  settle(bid, now)
end

-- Record the final result of one query once; returns its index in the result list, or -1
-- when the query already had a result (results are write-once per query id).
-- A query still marked queued was requeued after its lease lapsed and is finished late by
-- its old worker: its id leaves the queue holding it, and its tokens that queue's counter.
-- A query of an expiring batch that its worker reports cancelled (it aborted it) is recorded as expired.
-- The batch counts its unfinished predicted tokens by cluster (left:<cluster>) and, for answered
-- queries, their predicted and actual (prompt + completion) tokens: its token progress.
local function finish(g, result, kind, actual, now, prompt)
  local bid, qid = split_gid(g)
  local b = k_batch(bid)
  local status = redis.call('HGET', b, 'status')
  if not status then  -- its batch expired: nothing to record
    redis.call('DEL', k_query(g))
    return -1
  end
  if redis.call('SADD', k_done(bid), qid) == 0 then return -1 end
  if kind == 'cancelled' and stop_reason(status) == 'batch_expired' then
    local r = cjson.decode(result)
    if r.finish_reason ~= 'batch_expired' then
      r.finish_reason, r.error = 'batch_expired', EXPIRED_ERROR
      result = cjson.encode(r)
    end
  end
  local q = k_query(g)
  local h = redis.call('HMGET', q, 'cluster', 'tokens', 'state')
  local cluster, tokens, state = h[1], tonumber(h[2] or '0'), h[3]
  local idx = redis.call('RPUSH', k_results(bid), result) - 1
  redis.call('HINCRBY', b, kind, 1)
  if cluster then
    redis.call('ZREM', k_inflight(cluster), g)
    if state == 'queued' and redis.call('ZREM', k_queue(cluster), g) > 0 then
      redis.call('INCRBYFLOAT', k_pending(cluster), -tokens)
    end
    redis.call('HINCRBYFLOAT', b, 'left:' .. cluster, -tokens)
    if kind == 'completed' then
      redis.call('HINCRBYFLOAT', b, 'done_predicted_tokens', tokens)
      redis.call('HINCRBY', b, 'done_actual_tokens', actual + (prompt or 0))
      redis.call('HINCRBY', k_cluster_stats(cluster), 'finished_total_tokens', actual + (prompt or 0))
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
      elseif h[1] == 'queued' and redis.call('ZREM', queue, g) > 0 then
        redis.call('INCRBYFLOAT', pending, -tonumber(h[4] or '0'))
        redis.call('HSET', q, 'state', 'running')
        redis.call('ZADD', inflight, deadline, g)
        n = n + 1
      end
    end
  end
  return n
end

-- The result of a query its batch stopped before it ran: why is stop_reason()'s ('cancelled', 'batch_expired').
local function stopped_result(g, cluster, why)
  local bid, qid = split_gid(g)
  local row = '{"batch_id":' .. cjson.encode(bid) .. ',"query_id":' .. cjson.encode(qid) ..
              ',"cluster":' .. cjson.encode(cluster or '') .. ',"finish_reason":"' .. why .. '"'
  if why == 'batch_expired' then row = row .. ',"error":' .. cjson.encode(EXPIRED_ERROR) end
  return row .. '}'
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

-- Lua: requeue_lapsed(c, inflight, queue, pending, now) puts cluster c's queries whose lease lapsed
-- by ``now`` back in its queue at their rank (their place in the order); returns how many (REQUEUE_EXPIRED, and REQUEUE_ALL
-- of workqueue.ticks for every cluster at once).
local function requeue_lapsed(c, inflight, queue, pending, now)
  local expired = redis.call('ZRANGEBYSCORE', inflight, '-inf', now)
  local n = 0
  for i = #expired, 1, -1 do
    local g = expired[i]
    redis.call('ZREM', inflight, g)
    local q = k_query(g)
    local h = redis.call('HMGET', q, 'state', 'tokens', 'rank')
    if h[1] == 'running' then
      redis.call('HSET', q, 'state', 'queued', 'cluster', c)
      redis.call('ZADD', queue, tonumber(h[3] or '0'), g)
      redis.call('INCRBYFLOAT', pending, tonumber(h[2] or '0'))
      n = n + 1
    end
  end
  return n
end
"""
)

LIBRARY = Library(keys.lua_functions(), ordering.lua_rank(), lease.LUA, QUEUE_FUNCTIONS, header=HEADER)
