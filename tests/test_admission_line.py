"""A delivery's admission that waits for its verdict (worker/admission_line.py), against a real Redis behind a
proxy that drops everything without closing: it gives up when the boot's validity does, not after the
ledger client's socket timeout and retries."""

from __future__ import annotations

import dataclasses
import time

import pytest
import redis

from celery_orphans.ledger import Ledger, Terms
from celery_orphans.store import Keys
from celery_orphans.worker.admission_line import admit
from tests.factories import work_entry
from tests.services import TcpProxy

TERMS = Terms(ttl=3600, single_flight=True)


def test_an_admission_is_answered_on_a_connection_of_its_own(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    e = work_entry("t")
    lease = ledger.keys.lease(e.node, e.boot)
    redis_client.set(lease, b"1", px=60_000)
    redis_client.script_flush()  # the script is loaded again when Redis lost it

    terms = dataclasses.replace(TERMS, lease=lease)  # the writing boot's, alive

    first = admit(ledger, e, [], terms, 1.0)
    again = admit(ledger, work_entry("t"), [], terms, 1.0)

    assert first.admitted and ledger.load(["t"])["t"] == e
    assert again.duplicate  # the same copy, its execution's boot alive


def test_an_admission_through_a_blackholed_link_gives_up_at_its_bound(redis_client: redis.Redis) -> None:
    proxy = TcpProxy(int(redis_client.connection_pool.connection_kwargs["port"]))
    try:
        # The ledger client's own timeouts and retries would wait 5 s and more.
        dark = Ledger(
            redis.Redis.from_url(proxy.url(), socket_timeout=5, socket_connect_timeout=5), Keys.current()
        )
        e = work_entry("t")
        admit(dark, work_entry("warm-up"), [], TERMS, 2.0)
        proxy.blackhole()

        started = time.monotonic()
        with pytest.raises((redis.TimeoutError, redis.ConnectionError)):
            admit(dark, e, [], TERMS, 0.3)
        took = time.monotonic() - started
    finally:
        proxy.close()

    assert took < 0.3 + 0.2, took
