"""The fixed-window rate limit of the HTTP endpoints, counted in Redis."""

from __future__ import annotations

from typing import Any

from celery_orphans import ratelimit

LIMIT = ratelimit.Limit(hits=3, seconds=60)


def test_hits_within_the_limit_need_no_wait_and_the_next_waits_out_the_window(redis_client: Any) -> None:
    assert [ratelimit.hit("user:1", LIMIT) for _ in range(3)] == [0, 0, 0]

    wait = ratelimit.hit("user:1", LIMIT)

    assert 59 <= wait <= 60


def test_each_name_is_counted_on_its_own(redis_client: Any) -> None:
    for _ in range(4):
        ratelimit.hit("user:1", LIMIT)

    assert ratelimit.hit("user:2", LIMIT) == 0


def test_the_window_starts_at_the_first_hit_and_its_key_expires(redis_client: Any) -> None:
    ratelimit.hit("user:1", LIMIT)

    [key] = redis_client.keys("*ratelimit*")
    assert 0 < redis_client.ttl(key) <= 60
