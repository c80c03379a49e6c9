"""The Lua the ledger runs inside Redis: each step that must see and change several keys at once.

Every script works on keys under one prefix (``celery_orphans.store.Keys``); the ledger (``ledger.py``)
names the keys and reads the answers.
"""

from __future__ import annotations

import hashlib

# KEYS[1..4]: the task's fence, entry, the in-flight index, its checkpoint. ARGV[1..10]: task id, retries,
# recovery attempt, token, entry JSON, time, the task's recovery cap (0: count no redelivery), the fence's
# TTL, the writing boot's lease key, and '1' to drop a duplicate of a live execution. Then, carried along
# so an acknowledgement costs the worker no round trip of its own: KEYS[5..] entries to remove,
# ARGV[11..] their token and task id in pairs. Those go first, so an entry being replaced by a new copy of
# the same task is removed before it is.
# An entry of the same copy (retries and attempt) still there was written by another execution of that
# very message. While that execution's boot holds its lease (or is the writer's own boot), it is alive:
# this delivery is a duplicate of it (a transport restoring a long task past its visibility timeout, an
# ETA copy, a redelivery after a lost connection), and is refused ('single flight'). Otherwise it is an
# orphan the broker has delivered again (RabbitMQ does at once when a worker dies): the delivery counts
# as a recovery, up to the cap; an entry handed back at a shutdown or a requeue is not counted. A copy a
# recovery sent carries a higher attempt than the entry it replaces, and is not counted again. The
# fence's 'copy' is the attempt the current copy carries, which such a count leaves as it was; the fence
# drops copies older than it.
# Returns {0 stale / 1 admitted / 2 admitted with a checkpoint / 3 a duplicate of a live execution,
# recoveries, 1 counted / 2 at the cap}, and the entry found for the same copy, if any: the record names
# the worker that lost the task, or the one that runs it.
ADMIT = """
for i = 5, #KEYS do
  local j = 11 + 2 * (i - 5)
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
local redelivered, found = 0, false
if tonumber(ARGV[7]) > 0 or ARGV[10] == '1' then
  local old = redis.call('HMGET', KEYS[2], 'token', 'copy', 'entry', 'lease', 'handed_back')
  if old[1] and old[2] == copy then
    found = old[3]
    local owner = old[4]
    if ARGV[10] == '1' and not old[5] and owner
        and (owner == ARGV[9] or redis.call('EXISTS', owner) == 1) then
      return {3, attempts, 0, found}
    end
    if tonumber(ARGV[7]) > 0 and not old[5] then
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
end
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[2], 'token', ARGV[4], 'entry', ARGV[5], 'copy', copy, 'lease', ARGV[9])
redis.call('ZADD', KEYS[3], ARGV[6], ARGV[1])
return {1 + redis.call('EXISTS', KEYS[4]), attempts, redelivered, found}
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
  local e = redis.call('HMGET', KEYS[i], 'token', 'entry', 'handed_back')
  local f = redis.call('HMGET', KEYS[i + 1], 'attempts', 'claimed', 'sent')
  out[#out + 1] = e[1]
  out[#out + 1] = e[2]
  out[#out + 1] = e[3]
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

# KEYS: a worker boot's lease, its node's boots, the watch, its machine's processes. ARGV: the lease's
# value, its length in ms, the boot id, '1' for the boot's first write, the boot's member of the watch
# and of its machine ("boot node"), its process ("pid start", or '' where no process can tell), how many
# lapsed boots to return. A renewal never brings back a lease that is gone: once it lapsed (or vanished),
# a sweep may have judged the boot dead, and the boot must give up what it runs instead. The node's boots
# keep, in Redis's own time (so no two hosts' clocks are compared), when each boot last renewed and until
# when that renewal holds: "renewed_ms:until_ms". The watch orders every boot by that instant, so any
# renewal sees at once which boots lapsed; the machine's hash lists the processes of the boots that run
# on it. Returns {1, lapsed members, the machine's hash as field, value, ...} if written, else {0}.
RENEW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local written
if ARGV[4] == '1' then
  written = redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2], 'NX')
else
  written = redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2], 'XX')
end
if not written then return {0} end
local until_ms = now + tonumber(ARGV[2])
redis.call('HSET', KEYS[2], ARGV[3], now .. ':' .. until_ms)
redis.call('ZADD', KEYS[3], until_ms, ARGV[5])
local limit = tonumber(ARGV[7])
local lapsed, neighbours = {}, {}
if limit > 0 then
  lapsed = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now, 'LIMIT', 0, limit)
end
if ARGV[6] ~= '' then
  redis.call('HSET', KEYS[4], ARGV[5], ARGV[6])
  redis.call('PEXPIRE', KEYS[4], 3 * tonumber(ARGV[2]))
  if limit > 0 then neighbours = redis.call('HGETALL', KEYS[4]) end
end
return {1, lapsed, neighbours}
"""

# KEYS: the watch. ARGV: a boot's member. Takes a lapsed boot off the watch, so that of the workers
# whose renewals saw it lapse, one starts a sweep. Returns 1 if this call took it, else 0.
CLAIM_LAPSED = """
local until_ms = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not until_ms then return 0 end
local t = redis.call('TIME')
if tonumber(until_ms) > tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) then return 0 end
redis.call('ZREM', KEYS[1], ARGV[1])
return 1
"""

# KEYS: a machine's processes, a boot's lease, its node's boots, the watch. ARGV: the boot's member,
# its process as the machine's hash records it, the boot id. A process on the same machine saw the
# boot's process exit: its lease goes and its record says so ("renewed_ms:0:exited"), so a sweep judges
# its tasks at once. Returns 1 if this call recorded it (of the workers that saw it, one sweeps), else 0.
EXITED = """
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('DEL', KEYS[2])
local record = redis.call('HGET', KEYS[3], ARGV[3])
local renewed = record and string.match(record, '^(%d+):') or '0'
redis.call('HSET', KEYS[3], ARGV[3], renewed .. ':0:exited')
redis.call('ZREM', KEYS[4], ARGV[1])
return 1
"""

# KEYS: a task's entry. ARGV: the token it was written with, the time. A worker hands the message of an
# execution back to the broker (a shutdown that cancels it, a requeue): the entry stays, so the task is
# not forgotten should the message never come back, but marked, so no sweep takes the execution for an
# orphan while the broker holds the message. Returns 1 if marked.
HAND_BACK = """
if redis.call('HGET', KEYS[1], 'token') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'handed_back', ARGV[2])
return 1
"""
