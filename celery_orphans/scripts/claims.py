"""The Lua of the sweep's side of the ledger: the entries and fences it loads, the claim before it acts
(``ClaimMode``), the hold's release, and an operator's lift of a task's recovery cap."""

from __future__ import annotations

import enum

# KEYS: entry and fence of each task, in pairs. Returns, for each task, its entry's token, text and
# hand-back time, then the fence's recovery count, the tokens its latest recovery claimed and sent, and the
# count an operator lifted its cap to: one call instead of two commands per task, which is most of a
# sweep's reading at ten thousand tasks. A task with neither an entry's text nor a fence (a result row's
# alone, never recovered: half the tasks of a sweep or more) is one nil instead of seven, which the
# client reads as it would the seven.
LOAD = """
local out = {}
for i = 1, #KEYS, 2 do
  local e = redis.call('HMGET', KEYS[i], 'token', 'entry', 'handed_back')
  local f = redis.call('HMGET', KEYS[i + 1], 'attempts', 'claimed', 'sent', 'lifted')
  if e[2] or f[1] or f[2] or f[3] or f[4] then
    out[#out + 1] = {e[1], e[2], e[3], f[1], f[2], f[3], f[4]}
  else
    out[#out + 1] = false
  end
end
return out
"""


# Claims an orphan for one action, only if nothing moved since the sweep looked: the entry still
# carries the observed token (or is still absent), no other sweep holds it, and the recovery count is
# unchanged. A recovery records in the fence which entry it claimed ('claimed') and that the copy it
# sends carries the new count ('copy', see ADMIT), and once its message is out, which entry it sent
# ('sent'): an entry left behind after that is never sent again, only its bookkeeping is finished
# ('complete'). Both leave the entry in place until the claimer commits (recovery/executor.py), so they also
# hold it ('held', 'held_until' on the entry): a sweep that looks before that commit, or between the
# commit and the release, reads the same token and count and must not act on the task a second time.
# The hold lapses after ARGV[7] seconds, so a claimer that died is followed by the next sweep.
# A terminal mark at the cap (ARGV[8] '1') keeps the entry, off the in-flight index and for as long as
# the fence lives, marked 'capped' with its index score: the message an operator's lift (LIFT) gives back
# to the sweeps. No release removes a capped entry.
class ClaimMode(str, enum.Enum):
    """What a claim takes a task for: ``CLAIM``'s ARGV[5]."""

    RECOVER = "recover"  # send it again: the count goes up and the fence drops every older copy
    COMPLETE = "complete"  # finish the bookkeeping of a recovery an earlier sweep sent
    TERMINAL = "terminal"  # mark it terminal: the fence drops every copy, whatever its retries
    FORGET = "forget"  # remove the entry of a task that finished


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
  if ARGV[8] == '1' and token then
    local score = redis.call('ZSCORE', KEYS[3], ARGV[6]) or tostring(now)
    redis.call('HDEL', KEYS[2], 'held', 'held_until', 'handed_back')
    redis.call('HSET', KEYS[2], 'capped', score)
    redis.call('EXPIRE', KEYS[2], ARGV[4])
    redis.call('ZREM', KEYS[3], ARGV[6])
    return attempts
  end
end
redis.call('DEL', KEYS[2])
redis.call('ZREM', KEYS[3], ARGV[6])
return attempts
"""


# KEYS: a task's fence, its entry, the in-flight index. ARGV: the task id. An operator lifts the cap of a
# task marked terminal at it: the fence admits copies again and allows one recovery more than it counts
# ('lifted'), and the entry kept at the cap goes back on the in-flight index, where the next sweep finds
# it and recovers it once (the fence's retries stay past every copy until that recovery's claim). Both
# are kept until then, however long the next sweep takes: that claim gives the fence its window again (a
# fence that expired under its lift took the lifted cap along, and the task was judged by its worker's
# lease again: alive after a pool loss, it was left for as long as that worker lived). The entry gets a
# token of its own: a release its worker queued for the capped delivery (its outbox sends removals after
# the acknowledgement, and holds them while Redis is out of its reach) lands on no entry, where it took
# the lifted message away and the sweeps never saw the task again. Returns
# {1 lifted / 0 no terminal fence (never marked terminal, or its window passed) / -1 marked terminal but
# no message kept (not at the cap, or it expired), the recovery count}.
LIFT = """
local f = redis.call('HMGET', KEYS[1], 'terminal', 'attempts')
local attempts = tonumber(f[2]) or 0
if f[1] ~= '1' then return {0, attempts} end
local score = redis.call('HGET', KEYS[2], 'capped')
if not score then return {-1, attempts} end
redis.call('HDEL', KEYS[1], 'terminal')
redis.call('HSET', KEYS[1], 'lifted', attempts + 1)
redis.call('PERSIST', KEYS[1])
redis.call('HDEL', KEYS[2], 'capped')
redis.call('HSET', KEYS[2], 'token', redis.call('HGET', KEYS[2], 'token') .. '~' .. (attempts + 1))
redis.call('PERSIST', KEYS[2])
redis.call('ZADD', KEYS[3], score, ARGV[1])
return {1, attempts}
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
