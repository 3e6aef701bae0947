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
* **A checkpoint is its worker's.** CHECKPOINT writes a query's partial output (:mod:`workqueue.partial`)
  only while the worker that sends it holds the query (its worker id and cluster, running or requeued
  after a lapse and not claimed since), so a late write never lands on another run's query; with
  ``release`` it gives a running query back as RELEASE does for one never started: its claim's attempt
  back (a preemption is not the query's failure). The partial output goes with the query's hash when
  its result is written (``finish``). Sent again, it writes the same thing and releases nothing more.
* **Poison queries fail at their next claim.** REQUEUE_EXPIRED puts every lapsed query back;
  CLAIM gives up on a popped query that already used its ``max_attempts`` claims: it is
  finished as ``failed`` (``finish_reason`` ``error``) and the rest of its batch goes on.
  Until then its live owner (an outage outlasted its lease) can still take it back.
"""

from __future__ import annotations

from workqueue.lua_queue import EXPIRED_ERROR, LIBRARY

__all__ = [
    "CLAIM",
    "CHECKPOINT",
    "CLAIM_STOPPED_MAX",
    "COMPLETE",
    "EXPIRED_ERROR",
    "RELEASE",
    "RENEW",
    "REQUEUE_EXPIRED",
    "RESENT",
    "WRITE_ID_TTL_S",
]

#: rows of stopped batches (cancelled, expiring) or out of attempts one CLAIM finishes at most: the rest are left to
#: the bounded sweep and the next claims, so one call never blocks Redis long whatever a stopped batch holds
CLAIM_STOPPED_MAX = 256

#: the fields CLAIM's reply has per query it hands out: gid, payload, attempts, enqueued_at, partial output
CLAIMED_FIELDS = 5

#: what COMPLETE answers when the same write already recorded the result (it was resent: its reply was lost);
#: -1 is a result there before, from another write (the query ran twice)
RESENT = -2
#: seconds a write's id is kept after it recorded a result (longer than a call's retries take)
WRITE_ID_TTL_S = 120

# KEYS: the query's hash, its batch's hash, the query's write-id key (``keys.result_write``). ARGV: gid, result JSON,
# kind (completed|failed|cancelled), actual (completion) tokens, now, prompt tokens, the write's id. Returns the
# result's index, -1 (a result was there) or RESENT (this write put it there: it was sent again).
COMPLETE = LIBRARY.script(
    f"local RESENT, WRITE_ID_TTL_S = {RESENT}, {WRITE_ID_TTL_S}\n"
    + r"""
local idx = finish(ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5], tonumber(ARGV[6] or '0'))
if idx >= 0 then  -- a mark, not a lease: the write's id in a hash of its own, set and read by this script
  redis.call('HSET', KEYS[3], 'id', ARGV[7])
  redis.call('EXPIRE', KEYS[3], WRITE_ID_TTL_S)
elseif redis.call('HGET', KEYS[3], 'id') == ARGV[7] then
  return RESENT
end
return idx
"""
)

# KEYS: queue, inflight, pending of the cluster, the call's reply key (``keys.claim_reply``). ARGV: cluster, n, lease
# seconds, worker id, now (caller's clock: timestamps only), max attempts (0: no limit), seconds the reply is kept,
# then the gids the worker runs, renewed first (``reassert``). Leases end at Redis time + lease seconds. A popped query
# that already had max attempts claims is finished as failed (it gave up), not handed out; such rows and those of
# stopped batches count to at most STOPPED_MAX per call (CLAIM_STOPPED_MAX). Returns a flat list: how
# many gave up, then gid, payload, attempts, enqueued_at, partial output ('' if none: workqueue.partial), ... for
# each newly claimed query. A cluster under a preemption notice (keys.NOTICE_UNTIL) claims nothing, as a removed one. A reply that hands out
# queries is kept under the call's id: the same call sent again (its reply was lost) answers it again and claims
# nothing more (an idle worker's empty ticks write nothing).
CLAIM = LIBRARY.script(
    f"local STOPPED_MAX = {CLAIM_STOPPED_MAX}\n"
    + r"""
local kept = redis.call('HGET', KEYS[4], 'reply')
if kept then return cjson.decode(kept) end
local c, n, worker, now, max_attempts = ARGV[1], tonumber(ARGV[2]), ARGV[4], ARGV[5], tonumber(ARGV[6])
local deadline = server_now() + tonumber(ARGV[3])
reassert(c, worker, deadline, KEYS[2], KEYS[1], KEYS[3], 8)
local out = {0}
local taken, gave_up, finished = 0, 0, 0
local info = redis.call('HMGET', k_cluster_info(c), 'state', F_NOTICE_UNTIL)
if info[1] == 'removed' or info[2] then n = 0 end  -- a removed or preempted cluster takes nothing new
while taken < n and finished < STOPPED_MAX do
  local popped = redis.call('ZPOPMIN', KEYS[1])
  local g = popped[1]
  if not g then break end
  local q = k_query(g)
  local fields = redis.call('HMGET', q, 'payload', 'tokens', 'enqueued_at', 'attempts', F_PARTIAL)
  if fields[1] then
    redis.call('INCRBYFLOAT', KEYS[3], -tonumber(fields[2] or '0'))
    local bid = split_gid(g)
    local status = redis.call('HGET', k_batch(bid), 'status')
    local used = tonumber(fields[4] or '0')
    local why = stop_reason(status)
    if why then
      redis.call('HSET', q, 'state', 'cancelling')  -- already popped: finish() must not scan the queue for it
      finish(g, stopped_result(g, c, why), 'cancelled', 0, now)
      finished = finished + 1
    elseif max_attempts > 0 and used >= max_attempts then
      redis.call('HSET', q, 'state', 'failing')  -- already popped: finish() must not scan the queue for it
      finish(g, gave_up_result(g, c, used, max_attempts), 'failed', 0, now)
      gave_up = gave_up + 1
      finished = finished + 1
    else
      local attempts = redis.call('HINCRBY', q, 'attempts', 1)
      redis.call('HSET', q, 'state', 'running', 'worker', worker, 'started_at', now, 'cluster', c)
      redis.call('ZADD', KEYS[2], deadline, g)
      out[#out + 1] = g
      out[#out + 1] = fields[1]
      out[#out + 1] = tostring(attempts)
      out[#out + 1] = fields[3] or '0'
      out[#out + 1] = fields[5] or ''
      taken = taken + 1
    end
  end
end
out[1] = gave_up
if taken > 0 then  -- an empty reply is not kept: sent again, the call claims what there is then
  redis.call('HSET', KEYS[4], 'reply', cjson.encode(out))
  redis.call('EXPIRE', KEYS[4], ARGV[7])
end
return out
"""
)

# KEYS: inflight, queue, pending of the cluster. ARGV: cluster, lease seconds, worker id ('': any), gid...
# Leases to Redis time + lease seconds: with a worker id by ``reassert``, else those still in flight.
RENEW = LIBRARY.script(
    r"""
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

# KEYS: inflight, queue, pending of the cluster. ARGV: cluster. Leases past their deadline (in Redis time) go back
# to the queue at their rank (a query that used its max attempts fails at its next CLAIM, unless its owner takes it
# back first). Returns how many were requeued.
REQUEUE_EXPIRED = LIBRARY.script(
    r"""
return requeue_lapsed(ARGV[1], KEYS[1], KEYS[2], KEYS[3], server_now())
"""
)

# KEYS: inflight, queue, pending of the cluster. ARGV: cluster, worker id, started (1|0), gid... A worker gives
# back the queries it still runs (state running, its worker id, this cluster, in flight): each lease ends now and
# the query goes back to the queue at its rank; one never started (0) gets its claim's attempt back. Another
# worker's query, a finished one, or one whose hash is gone is left alone (nothing is recreated). Returns how
# many queries went back to the queue (those whose lease had lapsed meanwhile too).
RELEASE = LIBRARY.script(
    r"""
local c, worker, started = ARGV[1], ARGV[2], ARGV[3] == '1'
for i = 4, #ARGV do
  local g = ARGV[i]
  local q = k_query(g)
  local h = redis.call('HMGET', q, 'state', 'worker', 'cluster')
  if h[1] == 'running' and h[2] == worker and h[3] == c and redis.call('ZADD', KEYS[1], 'XX', 'CH', 0, g) > 0 then
    if not started then redis.call('HINCRBY', q, 'attempts', -1) end
  end
end
return requeue_lapsed(c, KEYS[1], KEYS[2], KEYS[3], server_now())
"""
)

# KEYS: inflight, queue, pending of the cluster. ARGV: cluster, worker id, then (gid, release 1|0, partial JSON or '')
# triples. For each query this worker holds on this cluster (running, or requeued after a lapse and not claimed since)
# the partial output is written to its hash (F_PARTIAL); with release a running one goes back to the queue now, its
# claim's attempt taken back (it was preempted, it did not fail). Returns {requeued, written (1|0) per triple...}.
CHECKPOINT = LIBRARY.script(
    r"""
local c, worker = ARGV[1], ARGV[2]
local out, released = {0}, false
for i = 3, #ARGV, 3 do
  local g, release, partial = ARGV[i], ARGV[i + 1] == '1', ARGV[i + 2]
  local q = k_query(g)
  local h = redis.call('HMGET', q, 'state', 'worker', 'cluster')
  local mine = h[2] == worker and h[3] == c and (h[1] == 'running' or h[1] == 'queued')
  if mine and partial ~= '' then redis.call('HSET', q, F_PARTIAL, partial) end
  out[#out + 1] = mine and 1 or 0
  if mine and release and h[1] == 'running' and redis.call('ZADD', KEYS[1], 'XX', 'CH', 0, g) > 0 then
    redis.call('HINCRBY', q, 'attempts', -1)
    released = true
  end
end
if released then out[1] = requeue_lapsed(c, KEYS[1], KEYS[2], KEYS[3], server_now()) end
return out
"""
)
