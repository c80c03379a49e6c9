"""The Lua the ledger runs inside Redis: each step that must see and change several keys at once.

Every script works on keys under one prefix (``celery_orphans.store.Keys``); the ledger (``ledger.py``)
names the keys and reads the answers.
"""

from __future__ import annotations

import hashlib

# KEYS[1..4]: the task's fence, entry, the in-flight index, its checkpoint. ARGV[1..8]: task id, retries,
# recovery attempt, token, entry JSON, time, the task's recovery cap (0: count no redelivery) and the
# fence's TTL. Then, carried along so an acknowledgement costs the worker no round trip of its own:
# KEYS[5..] entries to remove, ARGV[9..] their token and task id in pairs. Those go first, so an entry
# being replaced by a new copy of the same task is removed before it is.
# An entry of the same copy (retries and attempt) still there, written by another execution, is an
# orphan the broker has delivered again (RabbitMQ does at once when a worker dies): the delivery counts
# as a recovery, up to the cap. A copy a recovery sent carries a higher attempt than the entry it
# replaces, and is not counted again. The fence's 'copy' is the attempt the current copy carries, which
# such a count leaves as it was; the fence drops copies older than it.
# Returns {0 stale / 1 admitted / 2 admitted with a checkpoint, recoveries, 1 counted / 2 at the cap},
# and for a redelivery, the entry it replaced: the record names the worker that lost the task.
ADMIT = """
for i = 5, #KEYS do
  local j = 9 + 2 * (i - 5)
  if redis.call('HGET', KEYS[i], 'token') == ARGV[j] then
    redis.call('DEL', KEYS[i])
    redis.call('ZREM', KEYS[3], ARGV[j + 1])
  end
end
local f = redis.call('HMGET', KEYS[1], 'attempts', 'retries', 'terminal', 'copy')
local attempts = tonumber(f[1]) or 0
local retries = tonumber(f[2]) or -1
local msg_retries = tonumber(ARGV[2])
local msg_attempt = tonumber(ARGV[3])
local current = tonumber(f[4]) or attempts
if f[3] == '1' and msg_retries <= retries then return {0, attempts, 0} end
if msg_retries < retries or (msg_retries == retries and msg_attempt < current) then
  return {0, attempts, 0}
end
local copy = ARGV[2] .. ':' .. ARGV[3]
local redelivered, lost = 0, false
if tonumber(ARGV[7]) > 0 then
  local old = redis.call('HMGET', KEYS[2], 'token', 'copy', 'entry')
  if old[1] and old[2] == copy then
    lost = old[3]
    if attempts >= tonumber(ARGV[7]) then
      redelivered = 2
    else
      attempts = attempts + 1
      redelivered = 1
      redis.call('HSET', KEYS[1], 'attempts', attempts, 'retries', ARGV[2], 'copy', ARGV[3])
      redis.call('EXPIRE', KEYS[1], ARGV[8])
    end
  end
end
redis.call('HSET', KEYS[2], 'token', ARGV[4], 'entry', ARGV[5], 'copy', copy)
redis.call('ZADD', KEYS[3], ARGV[6], ARGV[1])
return {1 + redis.call('EXISTS', KEYS[4]), attempts, redelivered, lost}
"""

ADMIT_SHA = hashlib.sha1(ADMIT.encode()).hexdigest()  # what Redis names it by

RELEASE = """
if redis.call('HGET', KEYS[1], 'token') == ARGV[1] then
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
  if redis.call('HGET', key, 'token') == ARGV[i] then
    redis.call('DEL', key)
    redis.call('ZREM', KEYS[#KEYS], ARGV[i + 1])
    released = released + 1
  end
end
return released
"""

# KEYS: entry and fence of each task, in pairs. Returns token and entry, then the fence's recovery count
# and the tokens its latest recovery claimed and sent, of each task, flat: one call instead of two
# commands per task, which is most of a sweep's reading at ten thousand tasks.
LOAD = """
local out = {}
for i = 1, #KEYS, 2 do
  local e = redis.call('HMGET', KEYS[i], 'token', 'entry')
  local f = redis.call('HMGET', KEYS[i + 1], 'attempts', 'claimed', 'sent')
  out[#out + 1] = e[1]
  out[#out + 1] = e[2]
  out[#out + 1] = f[1]
  out[#out + 1] = f[2]
  out[#out + 1] = f[3]
end
return out
"""

# Claims an orphan for one action, only if nothing moved since the sweep looked: the entry still
# carries the observed token (or is still absent), no other sweep holds it, and the recovery count is
# unchanged. A recovery records in the fence which entry it claimed ('claimed') and that the copy it
# sends carries the new count ('copy', see ADMIT), and once its message is out, which entry it sent
# ('sent'): an entry left behind after that is never sent again, only its bookkeeping is finished
# ('complete'). Both leave the entry in place until the claimer commits (sweep/actions.py), so they also
# hold it ('held', 'held_until' on the entry): a sweep that looks before that commit, or between the
# commit and the release, reads the same token and count and must not act on the task a second time.
# The hold lapses after ARGV[7] seconds, so a claimer that died is followed by the next sweep.
CLAIM = """
local token = redis.call('HGET', KEYS[2], 'token')
if ARGV[1] == '' then
  if token then return -1 end
elseif token ~= ARGV[1] then
  return -1
end
local now = tonumber(redis.call('TIME')[1])
if token then
  local hold = redis.call('HMGET', KEYS[2], 'held', 'held_until')
  if hold[1] == token and (tonumber(hold[2]) or 0) > now then return -1 end
end
local attempts = tonumber(redis.call('HGET', KEYS[1], 'attempts')) or 0
if attempts ~= tonumber(ARGV[2]) then return -1 end
local mode = ARGV[5]
if mode == 'complete' then
  if redis.call('HGET', KEYS[1], 'claimed') ~= ARGV[1] then return -1 end
  redis.call('HSET', KEYS[2], 'held', token, 'held_until', now + tonumber(ARGV[7]))
  return attempts
end
if mode == 'recover' then
  if redis.call('HGET', KEYS[1], 'sent') == ARGV[1] then return -1 end
  attempts = attempts + 1
  redis.call('HSET', KEYS[1], 'attempts', attempts, 'retries', ARGV[3], 'claimed', ARGV[1], 'copy', attempts)
  redis.call('EXPIRE', KEYS[1], ARGV[4])
  if token then
    redis.call('HSET', KEYS[2], 'held', token, 'held_until', now + tonumber(ARGV[7]))
  end
  return attempts
end
if mode == 'terminal' then
  redis.call('HSET', KEYS[1], 'attempts', attempts, 'retries', ARGV[3], 'terminal', '1')
  redis.call('EXPIRE', KEYS[1], ARGV[4])
end
redis.call('DEL', KEYS[2])
redis.call('ZREM', KEYS[3], ARGV[6])
return attempts
"""


# Lifts the hold of a claim whose sweep did not commit, so the next sweep need not wait for it to lapse.
UNCLAIM = """
if redis.call('HGET', KEYS[1], 'held') == ARGV[1] then
  redis.call('HDEL', KEYS[1], 'held', 'held_until')
  return 1
end
return 0
"""

# How long a claim holds other sweeps off an entry: longer than a sweep takes from its claim to
# its commit, as long as the Redis sweep lock lives (sweep/lock.py, REDIS_LOCK_SECONDS).
CLAIM_SECONDS = 300
