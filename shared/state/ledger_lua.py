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

# KEYS: states, counts, requests, run marker, rollout leases (all of one run: one slot)
# ARGV: marker value, require_marker ('1': the run must be open), dispatch deadline,
#       then (tid, request_json) pairs
# -> trajectories added, or -1 when the run's marker is required and gone (Redis lost its data)
# A trajectory enters ``queued`` with its dispatch deadline in the rollout lease zset (no owner):
# if no worker claims it by then, its message was lost and the reaper sends it again.
REGISTER = """
local states, counts, requests, marker, leases = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local marker_value, require_marker, deadline = ARGV[1], ARGV[2], ARGV[3]
if require_marker == '1' and redis.call('EXISTS', marker) == 0 then return -1 end
redis.call('SET', marker, marker_value, 'NX')
local added = 0
for i = 4, #ARGV, 2 do
  if redis.call('HSETNX', states, ARGV[i], 'queued') == 1 then
    redis.call('HSET', requests, ARGV[i], ARGV[i + 1])
    redis.call('HINCRBY', counts, 'queued', 1)
    redis.call('ZADD', leases, deadline, ARGV[i])
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
local states, counts, owners, leases, attempts, payloads, resends = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7]
local tid, token, deadline, claim_from, held, payload = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
if redis.call('HGET', owners, tid) == token then
  return {'ok', tostring(redis.call('HGET', attempts, tid))}
end
local state = redis.call('HGET', states, tid)
if state ~= claim_from then return {'skip', state or 'unknown'} end
if redis.call('HEXISTS', owners, tid) == 1 then return {'skip', 'leased'} end
local attempt = redis.call('HINCRBY', attempts, tid, 1)
if held ~= state then set_state(states, counts, tid, state, held) end
redis.call('HSET', owners, tid, token)
redis.call('ZADD', leases, deadline, tid)
redis.call('HDEL', resends, tid)
if payload ~= '' then redis.call('HSET', payloads, tid, payload) end
return {'ok', tostring(attempt)}
"""

# KEYS: states, owners, leases ; ARGV: deadline, held, then (tid, token) pairs -> the ids whose
# lease is no longer theirs (another state, or another owner): their holders should stop
HEARTBEAT = """
local states, owners, leases = KEYS[1], KEYS[2], KEYS[3]
local deadline, held = ARGV[1], ARGV[2]
local lost = {}
for i = 3, #ARGV, 2 do
  if redis.call('HGET', states, ARGV[i]) == held and redis.call('HGET', owners, ARGV[i]) == ARGV[i + 1] then
    redis.call('ZADD', leases, 'XX', deadline, ARGV[i])
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
# A trajectory carried inline (``shared.inline_trajectories``) is stored by the move that makes
# it ``uploaded`` (ARGV[9]), so a Redis that holds the state holds the trajectory; a move into
# ``consumed`` or ``failed`` deletes it (the trainer spilled a consumed one to the object store
# first), so Redis holds inline trajectories only while they are in flight.
# KEYS: states, counts, failures, stream, next stage's payloads, next stage's leases, inline
#       trajectories, then (owners, leases) per lease stage
# ARGV: tid, to_state, token ('' = no owner check), failure_reason, event_json ('' = none),
#       allowed from-states (comma-separated), next stage's payload ('' = keep), its dispatch
#       deadline (0 = none), the inline trajectory's JSON ('' = none), then (held state,
#       claim-from state) per lease stage
# -> {"ok", from_state} | {"skip", state or "not_owner"}
TRANSITION = _SET_STATE + """
local states, counts, failures, stream, next_payloads, next_leases, inline = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7]
local tid, to_state, token, failure_reason, event_json, allowed_from, next_payload, send_by, inline_json = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8], ARGV[9]
local state = redis.call('HGET', states, tid)
if not state then return {'skip', 'unknown'} end
if not string.find(',' .. allowed_from .. ',', ',' .. state .. ',', 1, true) then return {'skip', state} end
local owners, leases, waiting = nil, nil, nil
for i = 10, #ARGV, 2 do
  local stage = (i - 10) / 2
  if ARGV[i] == state then owners, leases = KEYS[8 + 2 * stage], KEYS[9 + 2 * stage]
  elseif ARGV[i + 1] == state then waiting = KEYS[9 + 2 * stage] end
end
if token ~= '' and (not owners or redis.call('HGET', owners, tid) ~= token) then
  return {'skip', 'not_owner'}
end
set_state(states, counts, tid, state, to_state)
if owners then redis.call('HDEL', owners, tid) end
if leases or waiting then redis.call('ZREM', leases or waiting, tid) end
if failure_reason ~= '' then redis.call('HSET', failures, tid, failure_reason) end
if event_json ~= '' then redis.call('XADD', stream, '*', 'event', event_json) end
if next_payload ~= '' then redis.call('HSET', next_payloads, tid, next_payload) end
if tonumber(send_by) > 0 then redis.call('ZADD', next_leases, send_by, tid) end
if inline_json ~= '' then redis.call('HSET', inline, tid, inline_json) end
if to_state == 'consumed' or to_state == 'failed' then redis.call('HDEL', inline, tid) end
return {'ok', state}
"""

# The messages of these trajectories were sent: their short send-by deadlines (``TRANSITION``)
# become dispatch deadlines, far enough ahead for a holder to claim them from the queue. The
# entries stay: a message lost after it was sent (the broker takes it off its queue before it
# records a delivery) is sent again once its deadline passes. A holder's lease is left alone.
# KEYS: owners, leases ; ARGV: deadline, then trajectory ids -> entries moved
SENT = """
local owners, leases = KEYS[1], KEYS[2]
local deadline = ARGV[1]
local moved = 0
for i = 2, #ARGV do
  if redis.call('HEXISTS', owners, ARGV[i]) == 0 then
    moved = moved + redis.call('ZADD', leases, 'XX', 'CH', deadline, ARGV[i])
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
# - Unless the stage's broker queue (kombu's Redis list) still holds messages (ARGV[10] '1': the
#   caller read it; the broker's Redis need not be the ledger's, so the script cannot): its own
#   may be one of them, and a copy would only join the back of the same queue. The deadline
#   moves one dispatch TTL ahead, nothing is sent or counted ('waiting'). A message that only
#   waits in a long queue (the pipeline stalled by an outage of Redis, a backlog) is not copied.
# - A lease last renewed before Redis itself restarted (deadline < ARGV[9]) was lost in a crash
#   of Redis, not by anything the trajectory did: its attempt does not count ('requeued').
# - Failing a trajectory deletes its inline copy (``TRANSITION`` says why).
# KEYS: states, counts, owners, leases, attempts, failures, stream, resends, inline
#       trajectories (all of one run)
# ARGV: tid, now, max_attempts, failed_event_json, held, claim_from, expired_reason, dispatch TTL (s),
#       forgive deadlines before (0: none), queue busy ('1': the stage's broker queue holds messages)
# -> "requeued" | "resent" | "waiting" | "failed" | "skip"
EXPIRE = _SET_STATE + """
local states, counts, owners, leases, attempts_hash, failures, stream, resends_hash, inline = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9]
local tid, now, max_attempts, failed_event, held, claim_from, expired_reason, dispatch_ttl, forgive_before, queue_busy = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8], ARGV[9], ARGV[10]
local deadline = redis.call('ZSCORE', leases, tid)
if not deadline or tonumber(deadline) > tonumber(now) then return 'skip' end
local state = redis.call('HGET', states, tid)
if redis.call('HDEL', owners, tid) == 0 then
  if state ~= claim_from then
    redis.call('ZREM', leases, tid)
    return 'skip'
  end
  if queue_busy == '1' then
    redis.call('ZADD', leases, tonumber(now) + tonumber(dispatch_ttl), tid)
    return 'waiting'
  end
  local resends = redis.call('HINCRBY', resends_hash, tid, 1)
  redis.call('ZADD', leases, tonumber(now) + tonumber(dispatch_ttl) * 2 ^ math.min(resends, 5), tid)
  return 'resent'
end
if state ~= held then
  redis.call('ZREM', leases, tid)
  return 'skip'
end
local attempts = tonumber(redis.call('HGET', attempts_hash, tid) or '0')
if tonumber(deadline) < tonumber(forgive_before) and attempts > 0 then
  attempts = redis.call('HINCRBY', attempts_hash, tid, -1)
end
local to = claim_from
if attempts >= tonumber(max_attempts) then
  to = 'failed'
  redis.call('ZREM', leases, tid)
  redis.call('HSET', failures, tid, expired_reason .. ' after ' .. attempts .. ' attempts')
  redis.call('XADD', stream, '*', 'event', failed_event)
  redis.call('HDEL', inline, tid)
else
  redis.call('ZADD', leases, tonumber(now) + tonumber(dispatch_ttl), tid)
end
if to ~= state then set_state(states, counts, tid, state, to) end
if to == 'failed' then return 'failed' end
return 'requeued'
"""

# The lease owner gives the trajectory back unfinished (its worker is shutting down): held ->
# claim_from, the lease ended and the attempt not counted, all in one call; a dispatch deadline
# replaces the lease, for the message the owner sends next.
# KEYS: states, counts, owners, leases, attempts ; ARGV: tid, token, held, claim_from, dispatch deadline
# -> {"ok", held} | {"skip", state or "not_owner"}
HAND_BACK = _SET_STATE + """
local states, counts, owners, leases, attempts = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local tid, token, held, claim_from, deadline = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local state = redis.call('HGET', states, tid)
if state ~= held then return {'skip', state or 'unknown'} end
if redis.call('HGET', owners, tid) ~= token then return {'skip', 'not_owner'} end
set_state(states, counts, tid, state, claim_from)
redis.call('ZADD', leases, deadline, tid)
redis.call('HDEL', owners, tid)
redis.call('HINCRBY', attempts, tid, -1)
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
local states, counts, failures, attempts, scoring_attempts, groups_done, stream, counters, staleness, leases = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10]
local group_id, reopened_field, filtered_field, deadline = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
if redis.call('SISMEMBER', groups_done, group_id) == 0 then return {'skip', 'not_decided'} end
for i = 5, #ARGV, 2 do
  local state = redis.call('HGET', states, ARGV[i])
  if state ~= 'failed' then return {'skip', state or 'unknown'} end
end
local retried = 0
for i = 5, #ARGV, 2 do
  local tid = ARGV[i]
  if ARGV[i + 1] == '' then
    set_state(states, counts, tid, 'failed', 'queued')
    redis.call('HDEL', failures, tid)
    redis.call('HDEL', attempts, tid)
    redis.call('HDEL', scoring_attempts, tid)
    redis.call('ZADD', leases, deadline, tid)
    retried = retried + 1
  else
    redis.call('XADD', stream, '*', 'event', ARGV[i + 1])
  end
end
redis.call('SREM', groups_done, group_id)
redis.call('HINCRBY', counters, reopened_field, 1)
if tonumber(redis.call('HGET', staleness, filtered_field) or '0') > 0 then redis.call('HINCRBY', staleness, filtered_field, -1) end
return {'ok', tostring(retried)}
"""
