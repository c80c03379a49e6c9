"""Redis calls bounded by the time given (worker/bounded.py), against a real Redis behind a proxy that
drops everything without closing: the call gives up at its bound, not after redis-py's timeouts and
retries."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
import redis

from celery_orphans import store
from celery_orphans.ledger import Ledger
from celery_orphans.store import Keys
from celery_orphans.worker import admission_line
from celery_orphans.worker.bounded import Line
from celery_orphans.worker.outbox import Outbox
from tests.factories import work_entry
from tests.faults import report
from tests.services import SentinelSet, TcpProxy


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


# --- through Redis Sentinel: the question of where the master is ------------------------------------------

SENTINELS = 3  # as a deployment lists them; redis-py asks each in turn, for up to its 1 s socket timeout


@pytest.fixture
def dark_sentinels(sentinel_servers: SentinelSet) -> Iterator[tuple[TcpProxy, Ledger]]:
    """A ledger reached through three sentinel addresses, all behind one proxy (blackholed by the test);
    the master itself stays reachable."""
    proxy = TcpProxy(sentinel_servers.sentinel.port)
    url = ";".join(f"sentinel://127.0.0.1:{proxy.port}/0" for _ in range(SENTINELS))
    client = store._connect(url, sentinel_servers.sentinel.name)
    try:
        yield proxy, Ledger(client, Keys.current())
    finally:
        proxy.close()
        client.close()


def _within(call: Callable[[], object]) -> float:
    """How long ``call`` took to fail for want of an answer."""
    started = time.monotonic()
    with pytest.raises((redis.TimeoutError, redis.ConnectionError)):
        call()
    return time.monotonic() - started


BOUND = 0.3


def test_through_blackholed_sentinels_a_line_gives_up_connecting_at_its_bound(
    dark_sentinels: tuple[TcpProxy, Ledger],
) -> None:
    """Before, the master lookup asked each sentinel for 1 s: 3.0 s here, whatever the bound."""
    proxy, ledger = dark_sentinels
    line = Line(ledger.client, "bounded-test")
    assert line.execute([("PING",)], 2.0)  # the sentinels name the master, which answers
    line.close()  # the next call connects anew, and asks the sentinels again
    proxy.blackhole()

    took = _within(lambda: line.execute([("PING",)], BOUND))
    report("bounded line through blackholed sentinels", took_seconds=took, bound_seconds=BOUND)

    proxy.restore()
    assert line.execute([("PING",)], 2.0)
    assert took < BOUND + 0.2, took


def test_through_blackholed_sentinels_the_fence_read_and_the_removal_made_at_once_give_up_at_their_bound(
    dark_sentinels: tuple[TcpProxy, Ledger],
) -> None:
    """The fence read of a delivery that runs unrecorded (``admission_line.stale``) and the removal the
    outbox makes at once (``release(now=True)``) connect through the sentinels when their connection was
    lost. Before, each waited 3.0 s here."""
    proxy, ledger = dark_sentinels
    entry = work_entry("dark-sentinel")
    assert admission_line.stale(ledger, entry, 2.0) is False
    admission_line._line_to(ledger).close()
    proxy.blackhole()

    fence_read = _within(lambda: admission_line.stale(ledger, entry, BOUND))
    outbox = Outbox(delay=60)
    started = time.monotonic()
    outbox.release(ledger, "dark-sentinel", "token", now=True, seconds=BOUND)
    removal = time.monotonic() - started
    report(
        "fence read and removal through blackholed sentinels",
        fence_read_seconds=fence_read,
        removal_seconds=removal,
        bound_seconds=BOUND,
    )

    assert outbox.take(ledger, 1.0) == [("dark-sentinel", "token")]  # left queued, for the outbox's thread
    assert fence_read < BOUND + 0.2, fence_read
    assert removal < BOUND + 0.2, removal


# --- the outbox's own connection, made on the worker's main loop for a first-hand delivery ---------------


def test_the_outboxs_connection_to_a_blackholed_ledger_gives_up_at_its_bound(
    redis_client: redis.Redis,
) -> None:
    """Before, the main loop waited out the client's 5 s socket timeout as it loaded the script: 5.0 s."""
    proxy = TcpProxy(port_of(redis_client))
    try:
        client = redis.Redis.from_url(proxy.url(), socket_timeout=5, socket_connect_timeout=5)
        ledger = Ledger(client, Keys.current())
        outbox = Outbox(delay=60)
        outbox.release(ledger, "done", "token")
        proxy.blackhole()

        took = _within(lambda: outbox.admit(ledger, work_entry("dark"), "lease", seconds=BOUND))
        report("outbox connection to a blackholed ledger", took_seconds=took, bound_seconds=BOUND)

        assert outbox.take(ledger, 1.0) == [("done", "token")]  # nothing was sent: the removal stays queued
        proxy.restore()
        outbox.admit(ledger, work_entry("healed"), "lease", seconds=2.0)  # the next write connects anew
        assert outbox.settle(2.0)
    finally:
        proxy.close()
        client.close()

    assert took < BOUND + 0.2, took


def test_through_blackholed_sentinels_the_outboxs_connection_gives_up_at_its_bound(
    dark_sentinels: tuple[TcpProxy, Ledger],
) -> None:
    """Before, the master lookup asked each sentinel for its 1 s, for the script's load (tried again) and
    for the connection: 12.7 s here, whatever the bound."""
    proxy, ledger = dark_sentinels
    proxy.blackhole()
    outbox = Outbox(delay=60)

    took = _within(lambda: outbox.admit(ledger, work_entry("dark-sentinel"), "lease", seconds=BOUND))
    report("outbox connection through blackholed sentinels", took_seconds=took, bound_seconds=BOUND)

    proxy.restore()
    outbox.admit(ledger, work_entry("healed"), "lease", seconds=2.0)
    assert outbox.settle(2.0)
    assert took < BOUND + 0.2, took
