"""The Lua of a delivery's ledger entry: its admission (or only the test of whether a recovery overtook
it), its release once the task ended, its hand-back to the broker."""

from __future__ import annotations

import hashlib

# KEYS[1..4]: the task's fence, entry, the in-flight index, its checkpoint. ARGV[1..12]: task id, retries,
# recovery attempt, token, entry JSON, time, the task's recovery cap (0: count no redelivery), the fence's
# TTL, the writing boot's lease key, '1' to drop a duplicate of a live execution, the writing boot's node
# record (the hash of its boots) and its boot id. Then, carried along so an acknowledgement costs the
# worker no round trip of its own: KEYS[5..] entries to remove, ARGV[13..] their token and task id in
# pairs. Those go first, so an entry being replaced by a new copy of the same task is removed before it is.
# An entry of the same copy (retries and attempt) still there was written by another execution of that
# very message. While that execution's boot is alive (its lease exists, or its node's record says its
# last renewal still holds, as the sweep judges it: a lease key evicted or deleted says nothing of its
# worker; or it is the writer's own boot), this delivery is a duplicate of it (a transport restoring a
# long task past its visibility timeout, an ETA copy, a redelivery after a lost connection, a recovery
# published twice), and is refused ('single flight'). Otherwise it is an orphan the broker has delivered
# again (RabbitMQ does at once when a worker dies): the delivery counts as a recovery, up to the cap; an
# entry handed back at a shutdown or a requeue is not counted. A copy a recovery sent carries a higher
# attempt than the entry it replaces, and is not counted again; the fence remembers that it was admitted
# ('ran'), so the same copy delivered again once its execution ended and its entry went (a recovery
# published twice) is dropped as stale. The fence's 'copy' is the attempt the current copy carries, which
# such a count leaves as it was; the fence drops copies older than it.
# An entry that already carries this write's token (ARGV[4]) is this very write's, made before by a try
# whose answer was lost (the writing boot gave the message back unrun, Redis refusing its mark, and,
# delivered again, sends it once more): it is neither a duplicate nor a redelivery to count again, and is
# written over.
# An entry is never written under a boot the sweep would judge gone (its lease key and its record's last
# renewal both lapsed): a write held up by the network (a dark link that heals) lands after the writer gave
# that boot up and ran the task unprotected, and an entry naming the gone boot would have it recovered
# beside that run. It is refused instead (4), as a write Redis refused is. So is a write whose token
# HAND_BACK made void (5): it reached Redis after its worker gave the message back (see there).
# Returns {0 stale / 1 admitted / 2 admitted with a checkpoint / 3 a duplicate of a live execution / 4 not
# written: the writing boot is gone / 5 not written: the token is void, recoveries, 1 counted / 2 at the
# cap}, and the entry found for the same copy, if any: the record names the worker that lost the task, or
# the one that runs it. The cap is the higher of ARGV[7] and the count an operator lifted it to
# ('lifted', see LIFT). An entry kept at the cap ('capped') is never released.
ADMIT = """
for i = 5, #KEYS do
  local j = 13 + 2 * (i - 5)
  if redis.call('HGET', KEYS[i], 'token') == ARGV[j] and redis.call('HEXISTS', KEYS[i], 'capped') == 0 then
    redis.call('DEL', KEYS[i])
    redis.call('ZREM', KEYS[3], ARGV[j + 1])
  end
end
local function alive(lease, record, boot)
  if redis.call('EXISTS', lease) == 1 then return true end
  if not record or not boot then return false end
  local renewal = redis.call('HGET', record, boot)
  local until_ms = renewal and tonumber(string.match(renewal, '^%d+:(%d+)$'))
  if not until_ms then return false end
  local t = redis.call('TIME')
  return until_ms > tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local f = redis.call('HMGET', KEYS[1], 'attempts', 'retries', 'terminal', 'copy', 'ran', 'lifted',
  'void:' .. ARGV[4])
local attempts = tonumber(f[1]) or 0
local retries = tonumber(f[2]) or -1
local msg_retries = tonumber(ARGV[2])
local msg_attempt = tonumber(ARGV[3])
local cap = math.max(tonumber(ARGV[7]), tonumber(f[6]) or 0)
local current = tonumber(f[4]) or attempts
if f[3] == '1' and msg_retries <= retries then return {0, attempts, 0} end
if msg_retries < retries or (msg_retries == retries and msg_attempt < current) then
  return {0, attempts, 0}
end
if f[7] then return {5, attempts, 0} end
if ARGV[9] ~= '' and not alive(ARGV[9], ARGV[11], ARGV[12]) then return {4, attempts, 0} end
local copy = ARGV[2] .. ':' .. ARGV[3]
local redelivered, found = 0, false
if tonumber(ARGV[7]) > 0 or ARGV[10] == '1' or msg_attempt > 0 then
  local old = redis.call('HMGET', KEYS[2], 'token', 'copy', 'entry', 'lease', 'handed_back', 'record', 'boot')
  if msg_attempt > 0 and f[5] == copy and old[2] ~= copy then return {0, attempts, 0} end
  if old[1] and old[2] == copy and old[1] ~= ARGV[4] then
    found = old[3]
    local owner = old[4]
    if ARGV[10] == '1' and not old[5] and owner and (owner == ARGV[9] or alive(owner, old[6], old[7])) then
      return {3, attempts, 0, found}
    end
    if tonumber(ARGV[7]) > 0 and not old[5] then
      if attempts >= cap then
        redelivered = 2
      else
        attempts = attempts + 1
        redelivered = 1
        redis.call('HSET', KEYS[1], 'attempts', attempts, 'retries', ARGV[2], 'copy', ARGV[3])
        redis.call('EXPIRE', KEYS[1], ARGV[8])
      end
    end
  end
end
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[2], 'token', ARGV[4], 'entry', ARGV[5], 'copy', copy, 'lease', ARGV[9],
  'record', ARGV[11], 'boot', ARGV[12])
redis.call('ZADD', KEYS[3], ARGV[6], ARGV[1])
if msg_attempt > 0 and redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HSET', KEYS[1], 'ran', copy) end
return {1 + redis.call('EXISTS', KEYS[4]), attempts, redelivered, found}
"""

# KEYS[1]: a task's fence. ARGV: a delivery's retries and recovery attempt. Returns 1 if the fence has
# moved past that copy: ADMIT's first test, reading only, for a worker that cannot write an entry (it holds
# no lease, or Redis refuses writes) yet must not run a copy a recovery overtook.
STALE = """
local f = redis.call('HMGET', KEYS[1], 'attempts', 'retries', 'terminal', 'copy')
local attempts = tonumber(f[1]) or 0
local retries = tonumber(f[2]) or -1
local msg_retries = tonumber(ARGV[1])
local current = tonumber(f[4]) or attempts
if f[3] == '1' and msg_retries <= retries then return 1 end
if msg_retries < retries or (msg_retries == retries and tonumber(ARGV[2]) < current) then return 1 end
return 0
"""

ADMIT_SHA = hashlib.sha1(ADMIT.encode()).hexdigest()  # what Redis names it by

# An entry kept at the cap (see CLAIM) is not released: it is the message a lift of the cap sends again.
RELEASE = """
if redis.call('HGET', KEYS[1], 'token') == ARGV[1] and redis.call('HEXISTS', KEYS[1], 'capped') == 0 then
  redis.call('DEL', KEYS[1])
  redis.call('ZREM', KEYS[2], ARGV[2])
  return 1
end
return 0
"""

# KEYS: the entry of each task, then the in-flight index. ARGV: token and task id of each, in pairs.
RELEASE_MANY = """
local released = 0
for i = 1, #ARGV, 2 do
  local key = KEYS[(i + 1) / 2]
  if redis.call('HGET', key, 'token') == ARGV[i] and redis.call('HEXISTS', key, 'capped') == 0 then
    redis.call('DEL', key)
    redis.call('ZREM', KEYS[#KEYS], ARGV[i + 1])
    released = released + 1
  end
end
return released
"""

# KEYS: a task's entry, its fence. ARGV: the token it was written with, the time, the fence's TTL. A
# worker hands the message of an execution back to the broker (a shutdown that cancels it, a requeue, a
# write that got no answer): the entry stays, so the task is not forgotten should the message never come
# back, but marked, so no sweep takes the execution for an orphan while the broker holds the message.
# The token is void from then on, whatever was found: a write made with it that Redis has not read yet
# (held up on a connection its worker closed when no answer came) would otherwise land after this mark
# and leave an unmarked entry naming the worker's live boot, which every admission of the message would
# take for a live duplicate. ADMIT refuses a void token; the fence keeps it for at least ``ttl`` seconds
# from the mark (a fence kept for good, by a lift of the cap, stays so). Returns 1 if marked.
HAND_BACK = """
local ttl = redis.call('TTL', KEYS[2])
redis.call('HSET', KEYS[2], 'void:' .. ARGV[1], '1')
if ttl == -2 or (ttl >= 0 and ttl < tonumber(ARGV[3])) then redis.call('EXPIRE', KEYS[2], ARGV[3]) end
if redis.call('HGET', KEYS[1], 'token') ~= ARGV[1] then return 0 end
if redis.call('HEXISTS', KEYS[1], 'capped') == 1 then return 0 end
redis.call('HSET', KEYS[1], 'handed_back', ARGV[2])
return 1
"""
