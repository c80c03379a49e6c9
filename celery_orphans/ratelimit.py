"""A fixed-window rate limit kept in Redis, so every process serving the endpoints counts together."""

from __future__ import annotations

import math
from dataclasses import dataclass

from celery_orphans.store import Keys, client


@dataclass(frozen=True)
class Limit:
    hits: int
    seconds: int


def hit(name: str, limit: Limit) -> int:
    """Count one hit against ``name``: 0 if it is within ``limit``, else the seconds to wait.

    The window starts at the first hit and lasts ``limit.seconds``. ``redis.RedisError`` passes through:
    the caller decides whether an uncounted request may go ahead.
    """
    key = f"{Keys.current().prefix}:ratelimit:{name}"
    pipe = client().pipeline(transaction=True)
    pipe.set(key, 0, ex=limit.seconds, nx=True)
    pipe.incr(key)
    pipe.pttl(key)
    _, count, ttl_ms = pipe.execute()
    if int(count) <= limit.hits:
        return 0
    return max(1, math.ceil(int(ttl_ms) / 1000)) if int(ttl_ms) > 0 else limit.seconds
