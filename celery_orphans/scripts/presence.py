"""The Lua of the workers' presence (``worker/presence.py``): recorded by each renewal, which also looks at
the presence of the boots that follow its own, and a boot whose presence was lost recorded gone."""

from __future__ import annotations

# The presence of worker processes (``worker/presence.py``): each holds a connection to this Redis
# subscribed to a channel of its own while it lives, which Redis drops within milliseconds of the kernel
# closing it (a SIGKILL, an OOM kill, a crash), and keeps for as long as its tcp-keepalive allows when
# the network goes silent. A boot's entry in the presence hash ("epoch missing_ms wait_ms channel": the
# wait is the boot's own, a heartbeat and some, within which it renews when alive) exists only
# while its own last renewal saw its channel subscribed on this very server (the epoch is the server's
# run_id: after a restart or a failover no subscription has been seen there yet, so none can be missed).
# Run after RENEW in the same round trip. KEYS: the presence hash, its ring, the watch. ARGV: the boot's
# member, its channel ('' while it holds no subscription), its place in the ring, how many boots that
# follow it in the ring to look at, its own wait in ms, its own early_ms. A boot whose
# channel has no subscriber is marked missing once (missing_ms, Redis's time); its own next renewal
# clears the mark or, still unsubscribed, removes its entry. A missing boot may be judged once its wait
# is over and, whatever Redis says of its connection, once its own executions are forfeit (until_ms -
# early_ms): a live worker stalled while its connection was closed at Redis's end has stopped them by
# then. Returns {1 if the boot's own channel is subscribed else 0, then member, ms left before it may be
# judged, for each boot looked at that is missing}.
PRESENCE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local epoch = string.match(redis.call('INFO', 'server'), 'run_id:(%w+)') or '-'
local own = 0
if ARGV[2] ~= '' then own = tonumber(redis.call('PUBSUB', 'NUMSUB', ARGV[2])[2]) end
if own > 0 then
  redis.call('HSET', KEYS[1], ARGV[1], epoch .. ' 0 ' .. ARGV[5] .. ' ' .. ARGV[6] .. ' ' .. ARGV[2])
  redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1])
  own = 1
else
  redis.call('HDEL', KEYS[1], ARGV[1])
  redis.call('ZREM', KEYS[2], ARGV[1])
end
local out = {own}
local n = tonumber(ARGV[4])
if n == 0 then return out end
local after = redis.call('ZRANGEBYSCORE', KEYS[2], '(' .. ARGV[3], '+inf', 'LIMIT', 0, n)
if #after < n then
  local wrapped = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', '(' .. ARGV[3], 'LIMIT', 0, n - #after)
  for _, m in ipairs(wrapped) do after[#after + 1] = m end
end
for _, m in ipairs(after) do
  local value = redis.call('HGET', KEYS[1], m)
  local until_ms = tonumber(redis.call('ZSCORE', KEYS[3], m))
  if not value or not until_ms or until_ms <= now then
    redis.call('HDEL', KEYS[1], m)
    redis.call('ZREM', KEYS[2], m)
  else
    local e, missing, wait, early, channel = string.match(value, '^(%S+) (%d+) (%d+) (%d+) (.*)$')
    if e == epoch then
      missing = tonumber(missing)
      if tonumber(redis.call('PUBSUB', 'NUMSUB', channel)[2]) > 0 then
        if missing > 0 then
          redis.call('HSET', KEYS[1], m, epoch .. ' 0 ' .. wait .. ' ' .. early .. ' ' .. channel)
        end
      else
        if missing == 0 then
          missing = now
          redis.call('HSET', KEYS[1], m, epoch .. ' ' .. now .. ' ' .. wait .. ' ' .. early .. ' ' .. channel)
        end
        out[#out + 1] = m
        out[#out + 1] = math.max(0, missing + tonumber(wait) - now, until_ms - tonumber(early) - now)
      end
    end
  end
end
return out
"""

# KEYS: the presence hash, its ring, the watch, the boot's lease, its node's boots. ARGV: the boot's
# member, the boot id. The boot's presence was marked missing on this server at least its wait ago, its
# channel still has no subscriber, the boot has not renewed since the mark, and its own executions are
# forfeit by now (its lease ends in early_ms or less: a live boot stalled has stopped them): a live
# worker renews within its wait, and its renewal clears the mark or removes the entry. Its lease goes
# and its record says so ("renewed_ms:0:presence"), so a sweep judges its tasks at once. Returns 1 if
# this call recorded it (of the workers that saw it, one sweeps), else 0.
PRESENCE_LOST = """
local value = redis.call('HGET', KEYS[1], ARGV[1])
if not value then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local epoch = string.match(redis.call('INFO', 'server'), 'run_id:(%w+)') or '-'
local e, missing, wait, early, channel = string.match(value, '^(%S+) (%d+) (%d+) (%d+) (.*)$')
missing = tonumber(missing)
if e ~= epoch or not missing or missing == 0 or now < missing + tonumber(wait) then return 0 end
if tonumber(redis.call('PUBSUB', 'NUMSUB', channel)[2]) > 0 then
  redis.call('HSET', KEYS[1], ARGV[1], epoch .. ' 0 ' .. wait .. ' ' .. early .. ' ' .. channel)
  return 0
end
local until_ms = tonumber(redis.call('ZSCORE', KEYS[3], ARGV[1]))
if until_ms and now < until_ms - tonumber(early) then return 0 end
local record = redis.call('HGET', KEYS[5], ARGV[2])
local renewed = record and tonumber(string.match(record, '^(%d+):%d+$'))
if not until_ms or until_ms <= now or not renewed or renewed >= missing then return 0 end
redis.call('DEL', KEYS[4])
redis.call('HSET', KEYS[5], ARGV[2], renewed .. ':0:presence')
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
return 1
"""
