"""The sliding-window rate limit of the admin's actions and the HTTP endpoints, counted in Redis."""

from __future__ import annotations

from typing import Any

from celery_orphans import ratelimit
from celery_orphans.store import Keys

LIMIT = ratelimit.Limit(hits=3, seconds=60)


def _key(name: str) -> str:
    return f"{Keys.current().prefix}:ratelimit:{name}"


def _earlier_hits(redis_client: Any, name: str, *ms_ago: int) -> None:
    """Requests counted ``ms_ago`` milliseconds before now, by Redis's clock."""
    seconds, micros = redis_client.time()
    now = seconds * 1000 + micros // 1000
    redis_client.zadd(_key(name), {f"earlier-{i}": now - ago for i, ago in enumerate(ms_ago)})


def test_hits_within_the_limit_need_no_wait_and_the_next_waits_out_the_window(redis_client: Any) -> None:
    assert [ratelimit.hit("user:1", LIMIT) for _ in range(3)] == [0, 0, 0]

    wait = ratelimit.hit("user:1", LIMIT)

    assert 59 <= wait <= 60


def test_requests_just_before_a_window_edge_still_count_just_after_it(redis_client: Any) -> None:
    # A fixed window starting at the first of these would have ended: three more would get through.
    _earlier_hits(redis_client, "user:1", 59_000, 59_100, 59_200)

    assert ratelimit.hit("user:1", LIMIT) == 1  # the oldest leaves the window within a second


def test_a_request_older_than_the_window_no_longer_counts(redis_client: Any) -> None:
    _earlier_hits(redis_client, "user:1", 61_000, 30_000, 20_000)

    assert ratelimit.hit("user:1", LIMIT) == 0
    assert 29 <= ratelimit.hit("user:1", LIMIT) <= 30  # the one of 30 s ago leaves in 30 s


def test_a_refused_request_is_not_counted(redis_client: Any) -> None:
    for _ in range(10):
        ratelimit.hit("user:1", LIMIT)

    assert redis_client.zcard(_key("user:1")) == 3


def test_each_name_is_counted_on_its_own(redis_client: Any) -> None:
    for _ in range(4):
        ratelimit.hit("user:1", LIMIT)

    assert ratelimit.hit("user:2", LIMIT) == 0


def test_the_counts_expire_with_the_window(redis_client: Any) -> None:
    ratelimit.hit("user:1", LIMIT)

    for key in redis_client.keys("*ratelimit*"):
        assert 0 < redis_client.pttl(key) <= 60_000
