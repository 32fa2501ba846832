"""The ledger's Lua scripts: each runs atomically in Redis, so a state, its counter, its lease
and its trainer event always change together (``shared.ledger`` says what they guarantee).

A lease stage (``shared.ledger.LeaseStage``) passes its own keys: ``owners`` (trajectory id ->
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

# KEYS: states, counts, requests, runs, run marker
# ARGV: run_id, marker value, require_marker ('1': the run must be open), then (tid, request_json) pairs
# -> trajectories added, or -1 when the run's marker is required and gone (Redis lost its data)
REGISTER = """
if ARGV[3] == '1' and redis.call('EXISTS', KEYS[5]) == 0 then return -1 end
redis.call('SET', KEYS[5], ARGV[2], 'NX')
local added = 0
redis.call('SADD', KEYS[4], ARGV[1])
for i = 4, #ARGV, 2 do
  if redis.call('HSETNX', KEYS[1], ARGV[i], 'queued') == 1 then
    redis.call('HSET', KEYS[3], ARGV[i], ARGV[i + 1])
    redis.call('HINCRBY', KEYS[2], 'queued', 1)
    added = added + 1
  end
end
return added
"""

# KEYS: states, counts, owners, leases, attempts, payloads
# ARGV: tid, token, deadline, claim_from, held, payload ('' = keep the stored one)
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

# Generic guarded transition. Leaving a state a lease stage holds ends that stage's lease; a
# token, when given, must be the one holding it. Entering the state the next stage claims
# from may store that stage's payload with a send-by deadline in the stage's lease zset, with
# no owner: if the message is not sent (and the entry removed, ``SENT``) by then, the stage's
# reaper finds it expired and sends the payload itself.
# KEYS: states, counts, failures, stream, next stage's payloads, next stage's leases,
#       then (owners, leases) per lease stage
# ARGV: tid, to_state, token ('' = no owner check), failure_reason, event_json ('' = none),
#       allowed from-states (comma-separated), next stage's payload ('' = none), its send-by
#       deadline, then the held state per lease stage
# -> {"ok", from_state} | {"skip", state or "not_owner"}
TRANSITION = _SET_STATE + """
local state = redis.call('HGET', KEYS[1], ARGV[1])
if not state then return {'skip', 'unknown'} end
if not string.find(',' .. ARGV[6] .. ',', ',' .. state .. ',', 1, true) then return {'skip', state} end
local owners, leases = nil, nil
for i = 9, #ARGV do
  if ARGV[i] == state then owners, leases = KEYS[5 + 2 * (i - 8)], KEYS[6 + 2 * (i - 8)] end
end
if ARGV[3] ~= '' and (not owners or redis.call('HGET', owners, ARGV[1]) ~= ARGV[3]) then
  return {'skip', 'not_owner'}
end
set_state(KEYS[1], KEYS[2], ARGV[1], state, ARGV[2])
if owners then
  redis.call('ZREM', leases, ARGV[1])
  redis.call('HDEL', owners, ARGV[1])
end
if ARGV[4] ~= '' then redis.call('HSET', KEYS[3], ARGV[1], ARGV[4]) end
if ARGV[5] ~= '' then redis.call('XADD', KEYS[4], '*', 'event', ARGV[5]) end
if ARGV[7] ~= '' then
  redis.call('HSET', KEYS[5], ARGV[1], ARGV[7])
  redis.call('ZADD', KEYS[6], ARGV[8], ARGV[1])
end
return {'ok', state}
"""

# The messages of these trajectories were sent: their send-by entries (``TRANSITION``) leave the
# stage's lease zset, unless a holder's lease already replaced them (it has an owner).
# KEYS: owners, leases ; ARGV: trajectory ids -> entries removed
SENT = """
local removed = 0
for i = 1, #ARGV do
  if redis.call('HEXISTS', KEYS[1], ARGV[i]) == 0 then removed = removed + redis.call('ZREM', KEYS[2], ARGV[i]) end
end
return removed
"""

# KEYS: states, counts, owners, leases, attempts, failures, stream
# ARGV: tid, now, max_attempts, failed_event_json, held, claim_from, expired_reason
# -> "requeued" | "failed" | "skip"
EXPIRE = _SET_STATE + """
local deadline = redis.call('ZSCORE', KEYS[4], ARGV[1])
if not deadline or tonumber(deadline) > tonumber(ARGV[2]) then return 'skip' end
redis.call('ZREM', KEYS[4], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
local state = redis.call('HGET', KEYS[1], ARGV[1])
if state ~= ARGV[5] then return 'skip' end
local attempts = tonumber(redis.call('HGET', KEYS[5], ARGV[1]) or '0')
local to = ARGV[6]
if attempts >= tonumber(ARGV[3]) then
  to = 'failed'
  redis.call('HSET', KEYS[6], ARGV[1], ARGV[7] .. ' after ' .. attempts .. ' attempts')
  redis.call('XADD', KEYS[7], '*', 'event', ARGV[4])
end
if to ~= state then set_state(KEYS[1], KEYS[2], ARGV[1], state, to) end
if to == 'failed' then return 'failed' end
return 'requeued'
"""

# The lease owner gives the trajectory back unfinished (its worker is shutting down): held ->
# claim_from, the lease ended and the attempt not counted, all in one call.
# KEYS: states, counts, owners, leases, attempts ; ARGV: tid, token, held, claim_from
# -> {"ok", held} | {"skip", state or "not_owner"}
HAND_BACK = _SET_STATE + """
local state = redis.call('HGET', KEYS[1], ARGV[1])
if state ~= ARGV[3] then return {'skip', state or 'unknown'} end
if redis.call('HGET', KEYS[3], ARGV[1]) ~= ARGV[2] then return {'skip', 'not_owner'} end
set_state(KEYS[1], KEYS[2], ARGV[1], state, ARGV[4])
redis.call('ZREM', KEYS[4], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('HINCRBY', KEYS[5], ARGV[1], -1)
return {'ok', state}
"""

# ``conveyor retry`` re-opens a GRPO group the trainer decided with every member failed
# (``shared.ledger_retry`` says what it guarantees).
# KEYS: states, counts, failures, attempts, scoring attempts, groups done, trainer stream,
#       trainer counters, staleness
# ARGV: group id, reopened counter, filtered field, then per member (tid, '' to retry it, or
#       the failed event JSON to announce again)
# -> {"ok", retried} | {"skip", why}
RETRY_GROUP = _SET_STATE + """
if redis.call('SISMEMBER', KEYS[6], ARGV[1]) == 0 then return {'skip', 'not_decided'} end
for i = 4, #ARGV, 2 do
  local state = redis.call('HGET', KEYS[1], ARGV[i])
  if state ~= 'failed' then return {'skip', state or 'unknown'} end
end
local retried = 0
for i = 4, #ARGV, 2 do
  local tid = ARGV[i]
  if ARGV[i + 1] == '' then
    set_state(KEYS[1], KEYS[2], tid, 'failed', 'queued')
    redis.call('HDEL', KEYS[3], tid)
    redis.call('HDEL', KEYS[4], tid)
    redis.call('HDEL', KEYS[5], tid)
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
