"""Redis calls bounded by the time given (worker/bounded.py), against a real Redis behind a proxy that
drops everything without closing: the call gives up at its bound, not after redis-py's timeouts and
retries."""

from __future__ import annotations

import time

import pytest
import redis

from celery_orphans.worker.bounded import Line
from tests.services import TcpProxy


def port_of(redis_client: redis.Redis) -> int:
    return int(redis_client.connection_pool.connection_kwargs["port"])


def test_a_call_answers_and_errors_come_back_as_replies(redis_client: redis.Redis) -> None:
    line = Line(redis_client, "bounded-test")

    ok, error = line.execute([("PING",), ("INCR", "bounded:counter")], 1.0)
    redis_client.set("bounded:text", "text")
    [not_a_number] = line.execute([("INCR", "bounded:text")], 1.0)

    assert ok in (b"PONG", "PONG") and error == 1
    assert isinstance(not_a_number, redis.ResponseError)


@pytest.mark.parametrize("connected", [True, False], ids=["connected", "connecting"])
def test_a_call_to_a_blackholed_redis_gives_up_at_its_bound(
    redis_client: redis.Redis, connected: bool
) -> None:
    proxy = TcpProxy(port_of(redis_client))
    try:
        # The client's own timeouts and retries would wait 4 x 5 s.
        client = redis.Redis.from_url(proxy.url(), socket_timeout=5, socket_connect_timeout=5)
        line = Line(client, "bounded-test")
        if connected:
            line.execute([("PING",)], 1.0)
        proxy.blackhole()

        started = time.monotonic()
        with pytest.raises((redis.TimeoutError, redis.ConnectionError)):
            line.execute([("PING",)], 0.3)
        took = time.monotonic() - started

        proxy.restore()
        assert line.execute([("PING",)], 2.0)  # the next call connects anew
    finally:
        proxy.close()

    assert took < 0.3 + 0.2, took
