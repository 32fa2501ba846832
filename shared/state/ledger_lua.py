"""The ledger's Lua scripts: each runs atomically in Redis, so a state, its counter, its lease
and its trainer event always change together (``shared.state.ledger`` says what they guarantee).

A lease stage (``shared.state.ledger.LeaseStage``) passes its own keys: ``owners`` (trajectory id ->
token of the attempt holding the lease), ``leases`` (zset trajectory id -> deadline),
``attempts`` and ``payloads`` (what a re-dispatch publishes again).
"""

# The one way a state changes: its counters move with it (prepended to the scripts below).
_SET_STATE = """
local function set_state(states, counts, tid, from, to)
  redis.call('HSET', states, tid, to)
  redis.call('HINCRBY', counts, from, -1)
  redis.call('HINCRBY', counts, to, 1)
end
"""

# KEYS: states, counts, requests, runs, run marker, rollout leases
# ARGV: run_id, marker value, require_marker ('1': the run must be open), dispatch deadline,
#       then (tid, request_json) pairs
# -> trajectories added, or -1 when the run's marker is required and gone (Redis lost its data)
# A trajectory enters ``queued`` with its dispatch deadline in the rollout lease zset (no owner):
# if no worker claims it by then, its message was lost and the reaper sends it again.
REGISTER = """
if ARGV[3] == '1' and redis.call('EXISTS', KEYS[5]) == 0 then return -1 end
redis.call('SET', KEYS[5], ARGV[2], 'NX')
local added = 0
redis.call('SADD', KEYS[4], ARGV[1])
for i = 5, #ARGV, 2 do
  if redis.call('HSETNX', KEYS[1], ARGV[i], 'queued') == 1 then
    redis.call('HSET', KEYS[3], ARGV[i], ARGV[i + 1])
    redis.call('HINCRBY', KEYS[2], 'queued', 1)
    redis.call('ZADD', KEYS[6], ARGV[4], ARGV[i])
    added = added + 1
  end
end
return added
"""

# KEYS: states, counts, owners, leases, attempts, payloads, resends
# ARGV: tid, token, deadline, claim_from, held, payload ('' = keep the stored one)
# The lease replaces the trajectory's dispatch deadline in the same zset, and its re-send count
# starts again.
# -> {"ok", attempt} | {"skip", state or "leased"}
# A claim sent again with its token (its first reply was lost with the connection) finds its
# own lease and answers as the first call did, instead of "leased" by an owner nobody knows.
CLAIM = _SET_STATE + """
if redis.call('HGET', KEYS[3], ARGV[1]) == ARGV[2] then
  return {'ok', tostring(redis.call('HGET', KEYS[5], ARGV[1]))}
end
local state = redis.call('HGET', KEYS[1], ARGV[1])
if state ~= ARGV[4] then return {'skip', state or 'unknown'} end
if redis.call('HEXISTS', KEYS[3], ARGV[1]) == 1 then return {'skip', 'leased'} end
local attempt = redis.call('HINCRBY', KEYS[5], ARGV[1], 1)
if ARGV[5] ~= state then set_state(KEYS[1], KEYS[2], ARGV[1], state, ARGV[5]) end
redis.call('HSET', KEYS[3], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[4], ARGV[3], ARGV[1])
redis.call('HDEL', KEYS[7], ARGV[1])
if ARGV[6] ~= '' then redis.call('HSET', KEYS[6], ARGV[1], ARGV[6]) end
return {'ok', tostring(attempt)}
"""

# KEYS: states, owners, leases ; ARGV: deadline, held, then (tid, token) pairs -> the ids whose
# lease is no longer theirs (another state, or another owner): their holders should stop
HEARTBEAT = """
local lost = {}
for i = 3, #ARGV, 2 do
  if redis.call('HGET', KEYS[1], ARGV[i]) == ARGV[2] and redis.call('HGET', KEYS[2], ARGV[i]) == ARGV[i + 1] then
    redis.call('ZADD', KEYS[3], 'XX', ARGV[1], ARGV[i])
  else
    lost[#lost + 1] = ARGV[i]
  end
end
return lost
"""

# Generic guarded transition. Leaving a state a lease stage holds ends that stage's lease;
# leaving the state a stage claims from, unclaimed, ends its dispatch deadline. A token, when
# given, must be the one holding the lease. Entering the state the next stage claims from arms
# that stage's dispatch deadline (a send-by entry with no owner in the stage's lease zset) and
# may store its payload: if no holder claims it by then (the message was never sent, or lost),
# the stage's reaper sends the payload itself.
# KEYS: states, counts, failures, stream, next stage's payloads, next stage's leases,
#       then (owners, leases) per lease stage
# ARGV: tid, to_state, token ('' = no owner check), failure_reason, event_json ('' = none),
#       allowed from-states (comma-separated), next stage's payload ('' = keep), its dispatch
#       deadline (0 = none), then (held state, claim-from state) per lease stage
# -> {"ok", from_state} | {"skip", state or "not_owner"}
TRANSITION = _SET_STATE + """
local state = redis.call('HGET', KEYS[1], ARGV[1])
if not state then return {'skip', 'unknown'} end
if not string.find(',' .. ARGV[6] .. ',', ',' .. state .. ',', 1, true) then return {'skip', state} end
local owners, leases, waiting = nil, nil, nil
for i = 9, #ARGV, 2 do
  local stage = (i - 9) / 2
  if ARGV[i] == state then owners, leases = KEYS[7 + 2 * stage], KEYS[8 + 2 * stage]
  elseif ARGV[i + 1] == state then waiting = KEYS[8 + 2 * stage] end
end
if ARGV[3] ~= '' and (not owners or redis.call('HGET', owners, ARGV[1]) ~= ARGV[3]) then
  return {'skip', 'not_owner'}
end
set_state(KEYS[1], KEYS[2], ARGV[1], state, ARGV[2])
if owners then redis.call('HDEL', owners, ARGV[1]) end
if leases or waiting then redis.call('ZREM', leases or waiting, ARGV[1]) end
if ARGV[4] ~= '' then redis.call('HSET', KEYS[3], ARGV[1], ARGV[4]) end
if ARGV[5] ~= '' then redis.call('XADD', KEYS[4], '*', 'event', ARGV[5]) end
if ARGV[7] ~= '' then redis.call('HSET', KEYS[5], ARGV[1], ARGV[7]) end
if tonumber(ARGV[8]) > 0 then redis.call('ZADD', KEYS[6], ARGV[8], ARGV[1]) end
return {'ok', state}
"""

# The messages of these trajectories were sent: their short send-by deadlines (``TRANSITION``)
# become dispatch deadlines, far enough ahead for a holder to claim them from the queue. The
# entries stay: a message lost after it was sent (the broker takes it off its queue before it
# records a delivery) is sent again once its deadline passes. A holder's lease is left alone.
# KEYS: owners, leases ; ARGV: deadline, then trajectory ids -> entries moved
SENT = """
local moved = 0
for i = 2, #ARGV do
  if redis.call('HEXISTS', KEYS[1], ARGV[i]) == 0 then
    moved = moved + redis.call('ZADD', KEYS[2], 'XX', 'CH', ARGV[1], ARGV[i])
  end
end
return moved
"""

# A deadline in a stage's lease zset passed.
# - A lease (an owner): its holder is presumed dead. The attempt counts; past max_attempts the
#   trajectory fails, else it goes back where the stage claims from ('requeued') with a dispatch
#   deadline for the message the reaper sends now.
# - A dispatch deadline (no owner) of a trajectory still waiting to be claimed: its message was
#   never sent, or lost. No attempt was made, so none counts ('resent'); the next deadline is
#   further ahead each time (dispatch TTL x 2^resends, up to x32).
# - Unless the stage's broker queue (KEYS[9], kombu's Redis list) still holds messages: its own
#   may be one of them, and a copy would only join the back of the same queue. The deadline
#   moves one dispatch TTL ahead, nothing is sent or counted ('waiting'). A message that only
#   waits in a long queue (the pipeline stalled by an outage of Redis, a backlog) is not copied.
# - A lease last renewed before Redis itself restarted (deadline < ARGV[9]) was lost in a crash
#   of Redis, not by anything the trajectory did: its attempt does not count ('requeued').
# KEYS: states, counts, owners, leases, attempts, failures, stream, resends, the stage's broker queue
# ARGV: tid, now, max_attempts, failed_event_json, held, claim_from, expired_reason, dispatch TTL (s),
#       forgive deadlines before (0: none)
# -> "requeued" | "resent" | "waiting" | "failed" | "skip"
EXPIRE = _SET_STATE + """
local deadline = redis.call('ZSCORE', KEYS[4], ARGV[1])
if not deadline or tonumber(deadline) > tonumber(ARGV[2]) then return 'skip' end
local state = redis.call('HGET', KEYS[1], ARGV[1])
if redis.call('HDEL', KEYS[3], ARGV[1]) == 0 then
  if state ~= ARGV[6] then
    redis.call('ZREM', KEYS[4], ARGV[1])
    return 'skip'
  end
  if redis.call('LLEN', KEYS[9]) > 0 then
    redis.call('ZADD', KEYS[4], tonumber(ARGV[2]) + tonumber(ARGV[8]), ARGV[1])
    return 'waiting'
  end
  local resends = redis.call('HINCRBY', KEYS[8], ARGV[1], 1)
  redis.call('ZADD', KEYS[4], tonumber(ARGV[2]) + tonumber(ARGV[8]) * 2 ^ math.min(resends, 5), ARGV[1])
  return 'resent'
end
if state ~= ARGV[5] then
  redis.call('ZREM', KEYS[4], ARGV[1])
  return 'skip'
end
local attempts = tonumber(redis.call('HGET', KEYS[5], ARGV[1]) or '0')
if tonumber(deadline) < tonumber(ARGV[9]) and attempts > 0 then
  attempts = redis.call('HINCRBY', KEYS[5], ARGV[1], -1)
end
local to = ARGV[6]
if attempts >= tonumber(ARGV[3]) then
  to = 'failed'
  redis.call('ZREM', KEYS[4], ARGV[1])
  redis.call('HSET', KEYS[6], ARGV[1], ARGV[7] .. ' after ' .. attempts .. ' attempts')
  redis.call('XADD', KEYS[7], '*', 'event', ARGV[4])
else
  redis.call('ZADD', KEYS[4], tonumber(ARGV[2]) + tonumber(ARGV[8]), ARGV[1])
end
if to ~= state then set_state(KEYS[1], KEYS[2], ARGV[1], state, to) end
if to == 'failed' then return 'failed' end
return 'requeued'
"""

# The lease owner gives the trajectory back unfinished (its worker is shutting down): held ->
# claim_from, the lease ended and the attempt not counted, all in one call; a dispatch deadline
# replaces the lease, for the message the owner sends next.
# KEYS: states, counts, owners, leases, attempts ; ARGV: tid, token, held, claim_from, dispatch deadline
# -> {"ok", held} | {"skip", state or "not_owner"}
HAND_BACK = _SET_STATE + """
local state = redis.call('HGET', KEYS[1], ARGV[1])
if state ~= ARGV[3] then return {'skip', state or 'unknown'} end
if redis.call('HGET', KEYS[3], ARGV[1]) ~= ARGV[2] then return {'skip', 'not_owner'} end
set_state(KEYS[1], KEYS[2], ARGV[1], state, ARGV[4])
redis.call('ZADD', KEYS[4], ARGV[5], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('HINCRBY', KEYS[5], ARGV[1], -1)
return {'ok', state}
"""

# ``conveyor retry`` re-opens a GRPO group the trainer decided with every member failed
# (``shared.state.ledger_retry`` says what it guarantees).
# KEYS: states, counts, failures, attempts, scoring attempts, groups done, trainer stream,
#       trainer counters, staleness, rollout leases
# ARGV: group id, reopened counter, filtered field, dispatch deadline, then per member (tid, ''
#       to retry it, or the failed event JSON to announce again)
# -> {"ok", retried} | {"skip", why}
RETRY_GROUP = _SET_STATE + """
if redis.call('SISMEMBER', KEYS[6], ARGV[1]) == 0 then return {'skip', 'not_decided'} end
for i = 5, #ARGV, 2 do
  local state = redis.call('HGET', KEYS[1], ARGV[i])
  if state ~= 'failed' then return {'skip', state or 'unknown'} end
end
local retried = 0
for i = 5, #ARGV, 2 do
  local tid = ARGV[i]
  if ARGV[i + 1] == '' then
    set_state(KEYS[1], KEYS[2], tid, 'failed', 'queued')
    redis.call('HDEL', KEYS[3], tid)
    redis.call('HDEL', KEYS[4], tid)
    redis.call('HDEL', KEYS[5], tid)
    redis.call('ZADD', KEYS[10], ARGV[4], tid)
    retried = retried + 1
  else
    redis.call('XADD', KEYS[7], '*', 'event', ARGV[i + 1])
  end
end
redis.call('SREM', KEYS[6], ARGV[1])
redis.call('HINCRBY', KEYS[8], ARGV[2], 1)
if tonumber(redis.call('HGET', KEYS[9], ARGV[3]) or '0') > 0 then redis.call('HINCRBY', KEYS[9], ARGV[3], -1) end
return {'ok', tostring(retried)}
"""
