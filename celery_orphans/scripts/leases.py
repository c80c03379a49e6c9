"""The Lua of the workers' leases: a renewal (which also reports the boots that lapsed and the processes on
the machine), a lapsed boot taken off the watch by one worker, a process seen to exit."""

from __future__ import annotations

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
