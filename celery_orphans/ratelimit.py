"""A sliding-window rate limit kept in Redis, so every process serving the admin and the API counts together.

Each counted request is a member of a sorted set scored by Redis's clock; the window is the last
``seconds``: at most ``hits`` requests in any span of that length, with no edge at which a second burst
can follow the first (a fixed window lets twice its limit through across its edge).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from celery_orphans.store import Keys, client

# KEYS[1]: the set of one name. ARGV: the window in ms, the limit. Counts the request if the window has
# room and returns 0; otherwise returns the ms until the oldest request in it leaves the window.
_HIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local window = tonumber(ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)
if redis.call('ZCARD', KEYS[1]) < tonumber(ARGV[2]) then
  redis.call('ZADD', KEYS[1], now, t[1] .. '.' .. t[2] .. '.' .. redis.call('INCR', KEYS[1] .. ':n'))
  redis.call('PEXPIRE', KEYS[1], window)
  redis.call('PEXPIRE', KEYS[1] .. ':n', window)
  return 0
end
local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
return math.max(1, tonumber(oldest[2]) + window - now)
"""


@dataclass(frozen=True)
class Limit:
    hits: int
    seconds: int


def hit(name: str, limit: Limit) -> int:
    """Count one request against ``name``: 0 if it is within ``limit``, else the whole seconds to wait.

    A refused request is not counted. ``redis.RedisError`` passes through: the caller decides whether an
    uncounted request may go ahead.
    """
    key = f"{Keys.current().prefix}:ratelimit:{name}"
    wait_ms = int(client().register_script(_HIT)(keys=[key], args=[limit.seconds * 1000, limit.hits]))
    return 0 if wait_ms == 0 else max(1, math.ceil(wait_ms / 1000))
