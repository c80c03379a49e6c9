"""Ledger writes off the worker's path: entries sent without waiting, removals carried or flushed."""

from __future__ import annotations

import contextlib
import logging
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any

import pytest
import redis

from celery_orphans.entry import Entry
from celery_orphans.ledger import Ledger, ledger_for
from celery_orphans.store import Keys
from celery_orphans.worker import lifecycle
from celery_orphans.worker.line import OUTBOX_CLIENT_NAME, Write, redo
from celery_orphans.worker.outbox import Outbox
from tests.factories import work_entry
from tests.helpers import exit_code_of, wait_for
from tests.services import RedisServer, SentinelSet

LEASE = "celery_orphans:lease:celery@host:boot-a"  # the writing boot's, as a worker passes it


@pytest.fixture(autouse=True)
def lease_held(redis_client: redis.Redis) -> None:
    """The writing boot holds its lease, as a worker's does while it writes (no entry is written under a
    boot whose lease lapsed)."""
    redis_client.set(LEASE, b"1", px=600_000)


def recovered_once(redis_client: redis.Redis, task_id: str) -> None:
    """The fence a recovery leaves: every copy older than attempt 1 is stale."""
    redis_client.hset(Keys.current().fence(task_id), mapping={"attempts": 1, "retries": 0, "copy": 1})


def admitted(ledger: Ledger, task_id: str) -> Entry:
    e = work_entry(task_id, token=uuid.uuid4().hex)
    ledger.admit_delivery(e)
    return e


def test_an_entry_is_sent_without_waiting_and_is_in_redis_once_answered(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    outbox = Outbox(delay=60)
    e = work_entry("t")
    outbox.admit(ledger, work_entry("warm-up"), LEASE)  # the connection is made before Redis is paused
    redis_client.client_pause(2000, all=False)  # WRITE: every write waits

    started = time.monotonic()
    outbox.admit(ledger, e, LEASE)
    sent_in = time.monotonic() - started
    outbox.settle()

    assert sent_in < 1.0
    assert time.monotonic() - started >= 1.0  # settling waited for the answer
    assert ledger.load(["t"])["t"] == e


def test_an_entry_whose_connection_broke_before_the_answer_is_written_again(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    outbox = Outbox(delay=60)
    outbox.admit(ledger, work_entry("warm-up"), LEASE)
    outbox.settle()
    redis_client.client_pause(5000, all=False)
    e = work_entry("t")
    outbox.admit(ledger, e, LEASE)  # held by the pause, then dropped with its connection
    redis_client.client_kill_filter(_type="normal", skipme=True)
    redis_client.client_unpause()

    outbox.settle()

    assert ledger.load(["t"])["t"] == e


def test_a_queued_removal_goes_with_the_next_entry_sent(ledger: Ledger) -> None:
    outbox = Outbox(delay=60)  # the thread stays out of the way
    done = admitted(ledger, "done")
    outbox.release(ledger, "done", done.token)

    outbox.admit(ledger, work_entry("next"), LEASE)
    outbox.settle()

    assert ledger.load(["done", "next"])["done"] is None
    assert outbox.take(ledger) == []
    assert ledger.count() == 1


def test_an_error_answer_is_logged_and_the_connection_stays_usable(
    ledger: Ledger, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    outbox = Outbox(delay=60)
    redis_client.set(Keys.current().fence("bad"), "not a hash")  # the write fails inside Redis

    with caplog.at_level(logging.WARNING, logger="celery_orphans.worker.outbox"):
        outbox.admit(ledger, work_entry("bad"), LEASE)
        outbox.admit(ledger, work_entry("good"), LEASE)
        outbox.settle()

    assert "cannot record demoapp.work[bad] in the ledger" in caplog.text
    assert not redis_client.exists(Keys.current().entry("bad"))
    assert isinstance(ledger.load(["good"])["good"], Entry)


def test_a_copy_whose_fence_moved_on_is_logged_as_a_task_id_sent_twice(
    ledger: Ledger, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    outbox = Outbox(delay=60)
    recovered_once(redis_client, "twice")

    with caplog.at_level(logging.WARNING, logger="celery_orphans.worker.outbox"):
        outbox.admit(ledger, work_entry("twice"), LEASE)
        outbox.settle()

    assert "was the same task id sent twice?" in caplog.text
    assert ledger.load(["twice"])["twice"] is None


def test_an_entry_that_cannot_be_sent_raises_and_the_removals_stay_queued(redis_client: redis.Redis) -> None:
    nowhere = redis.Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=1)
    unreachable = Ledger(nowhere, Keys.current())
    outbox = Outbox(delay=60)
    outbox.release(unreachable, "done", "token")

    with pytest.raises(redis.ConnectionError):
        outbox.admit(unreachable, work_entry("t"), LEASE)

    assert outbox.take(unreachable) == [("done", "token")]


def test_a_queued_removal_is_flushed_by_the_thread_when_no_write_carries_it(ledger: Ledger) -> None:
    e = admitted(ledger, "t")
    outbox = Outbox()

    outbox.release(ledger, "t", e.token)

    wait_for(lambda: ledger.load(["t"])["t"] is None, 5, "the entry to be removed")
    assert ledger.count() == 0


def test_take_hands_the_queued_removals_to_one_writer_only(ledger: Ledger) -> None:
    outbox = Outbox(delay=60)
    outbox.release(ledger, "a", "token-a")
    outbox.release(ledger, "b", "token-b")

    assert outbox.take(ledger) == [("a", "token-a"), ("b", "token-b")]
    assert outbox.take(ledger) == []
    assert outbox.flush() == 0


def test_removals_given_back_after_a_failed_write_are_flushed_first(ledger: Ledger) -> None:
    first, second = admitted(ledger, "first"), admitted(ledger, "second")
    outbox = Outbox(delay=60)
    outbox.release(ledger, "second", second.token)
    taken = outbox.take(ledger)
    outbox.release(ledger, "first", first.token)

    outbox.give_back(ledger, taken)

    assert outbox.take(ledger) == [("second", second.token), ("first", first.token)]


def test_an_entry_sent_after_redis_lost_its_scripts_is_written_the_slow_way(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    outbox = Outbox(delay=60)
    outbox.admit(ledger, work_entry("warm-up"), LEASE)  # the script is loaded with the outbox's connection
    outbox.settle()
    redis_client.script_flush()
    e = work_entry("t")

    outbox.admit(ledger, e, LEASE)
    outbox.settle()

    assert ledger.load(["t"])["t"] == e


def test_answers_are_read_by_the_thread_without_another_write(
    ledger: Ledger, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    outbox = Outbox(delay=0.05)
    recovered_once(redis_client, "twice")

    with caplog.at_level(logging.WARNING, logger="celery_orphans.worker.outbox"):
        outbox.admit(ledger, work_entry("twice"), LEASE)
        wait_for(lambda: "was the same task id sent twice?" in caplog.text, 5, "the answer to be read")


def test_a_forked_child_writes_on_its_own_connection_even_if_the_fork_caught_the_lock_held(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    outbox = Outbox(delay=60)
    parent, child = work_entry("parent", token="p"), work_entry("child", token="c")
    outbox.admit(ledger, parent, LEASE)  # the parent's connection and thread exist
    parent_conn = outbox._lines[ledger].conn
    outbox._lock.acquire()  # as if the parent's thread were flushing when the worker forked
    try:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                outbox.admit(ledger, child, LEASE)
                outbox.settle()
                code = 0 if outbox._lines[ledger].conn is not parent_conn else 2
            finally:
                os._exit(code)
    finally:
        outbox._lock.release()

    assert exit_code_of(pid) == 0
    outbox.settle()
    assert ledger.load(["parent", "child"]) == {"parent": parent, "child": child}


def outbox_connections(server: RedisServer) -> int:
    return sum(1 for c in server.client().client_list() if c["name"] == OUTBOX_CLIENT_NAME)


@pytest.fixture
def sentinel_ledger(sentinel_servers: SentinelSet, settings: Any, own_clients: None) -> Ledger:
    """The ledger reached through the sentinels' ``orphans`` master, the writing boot's lease held there."""
    settings.CELERY_ORPHANS_REDIS_URL = sentinel_servers.sentinel.url()
    settings.CELERY_ORPHANS_REDIS_SENTINEL_MASTER = "orphans"
    ledger = ledger_for()
    ledger.client.set(LEASE, b"1", px=600_000)
    return ledger


def test_through_sentinel_the_outbox_writes_to_the_master_the_sentinels_name(
    sentinel_servers: SentinelSet, sentinel_ledger: Ledger
) -> None:
    ledger = sentinel_ledger
    outbox = Outbox(delay=60)
    e = work_entry("t")

    outbox.admit(ledger, e, LEASE)
    outbox.settle()

    assert outbox_connections(sentinel_servers.master) == 1
    assert ledger.load(["t"])["t"] == e


def test_through_sentinel_the_outbox_follows_a_failover_to_the_new_master(
    sentinel_servers: SentinelSet, sentinel_ledger: Ledger
) -> None:
    ledger = sentinel_ledger
    ledger.client.execute_command("WAIT", 1, 5000)  # the replica has it before it is promoted
    outbox = Outbox(delay=60)
    outbox.admit(ledger, work_entry("before"), LEASE)
    outbox.settle()
    sentinel_servers.master.stop()
    wait_for(
        lambda: sentinel_servers.sentinel.master_port() == sentinel_servers.replica.port,
        20,
        "the sentinel to promote the replica",
    )
    after = work_entry("after")

    # The first write after the failover finds its connection dead and is made again the slow way.
    with contextlib.suppress(redis.RedisError):
        outbox.admit(ledger, after, LEASE)
    outbox.settle()
    outbox.admit(ledger, work_entry("next"), LEASE)
    outbox.settle()

    assert outbox_connections(sentinel_servers.replica) == 1
    found = ledger.load(["before", "after", "next"])
    assert all(found.values()), found


def test_the_worker_never_waits_behind_the_outboxs_thread_while_the_ledger_is_blackholed(
    redis_client: redis.Redis,
) -> None:
    from tests.services import TcpProxy

    proxy = TcpProxy(int(redis_client.connection_pool.connection_kwargs["port"]))
    try:
        dark = Ledger(
            redis.Redis.from_url(proxy.url(), socket_timeout=3, socket_connect_timeout=3), Keys.current()
        )
        outbox = Outbox(delay=0.01)
        outbox.admit(dark, work_entry("warm-up"), LEASE)
        outbox.settle()
        proxy.blackhole()
        outbox.admit(dark, work_entry("unanswered"), LEASE)  # its answer never comes
        wait_for(lambda: outbox._reading.locked(), 2, "the thread to wait for the answer", interval=0.01)

        started = time.monotonic()
        outbox.release(dark, "done", "token")  # what the worker's main loop does at each acknowledgement
        outbox.admit(dark, work_entry("next"), LEASE)  # and at each first-hand delivery
        took = time.monotonic() - started
    finally:
        proxy.close()

    assert took < 0.5, f"the main loop waited {took:.2f} s behind the outbox's thread"


@pytest.fixture
def dark_link(redis_client: redis.Redis) -> Any:
    """A ledger through a proxy, and the proxy, which the test blackholes and restores."""
    from tests.services import TcpProxy

    proxy = TcpProxy(int(redis_client.connection_pool.connection_kwargs["port"]))
    dark = Ledger(
        redis.Redis.from_url(proxy.url(), socket_timeout=3, socket_connect_timeout=3), Keys.current()
    )
    yield dark, proxy
    proxy.close()


def test_a_bounded_take_leaves_the_removals_queued_while_an_answer_is_owed_on_a_dark_link(
    dark_link: Any,
) -> None:
    dark, proxy = dark_link
    outbox = Outbox(delay=60)
    outbox.admit(dark, work_entry("warm-up"), LEASE)
    outbox.settle()
    proxy.blackhole()
    outbox.admit(dark, work_entry("unanswered"), LEASE)
    outbox.release(dark, "done", "token")

    assert outbox.take(dark, 0.2) == []  # the removal may not overtake the entry owed before it

    proxy.restore()
    assert outbox.take(dark, 5) == [("done", "token")]


def test_a_bounded_release_now_over_a_dark_link_leaves_the_removal_queued(dark_link: Any) -> None:
    dark, proxy = dark_link
    outbox = Outbox(delay=60)
    outbox.admit(dark, work_entry("warm-up"), LEASE)
    outbox.settle()
    proxy.blackhole()

    outbox.release(dark, "done", "token", now=True, seconds=0.2)

    proxy.restore()
    assert outbox.take(dark, 5) == [("done", "token")]  # for the next write, or the thread, to carry


@dataclass
class Validity:
    """What the worker's heartbeat says is left of its boot's validity."""

    left: float

    def time_left(self) -> float:
        return self.left


def test_a_write_made_again_the_slow_way_is_recorded_within_the_boots_validity(
    ledger: Ledger, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lifecycle, "current", lambda: Validity(1.0))
    redis_client.script_flush()  # Redis lost its scripts: the write loads it again
    answers: list[bool] = []
    e = work_entry("t")

    redo(ledger, Write(e, [], LEASE, answers.append))

    assert answers == [True]
    assert ledger.load(["t"])["t"] == e


def test_a_write_made_again_over_a_dark_link_waits_no_longer_than_the_boots_validity(
    dark_link: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    dark, proxy = dark_link  # its client would wait 3 s for each try
    monkeypatch.setattr(lifecycle, "current", lambda: Validity(0.3))
    outbox = Outbox(delay=60)
    outbox.admit(dark, work_entry("warm-up"), LEASE)
    outbox.settle()
    proxy.blackhole()
    answers: list[bool] = []

    started = time.monotonic()
    redo(dark, Write(work_entry("t"), [], LEASE, answers.append))  # its line was lost
    took = time.monotonic() - started

    print(f"a write made again over a blackholed ledger gave up after {took:.2f} s")
    assert answers == [False]  # not recorded: it runs unprotected, as a refused write does
    assert took < 0.3 + 0.2, f"the write made again waited {took:.2f} s"
