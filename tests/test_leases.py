"""Worker leases against a real Redis: the key a heartbeat keeps alive, and what the sweep reads from it."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from django.conf import settings as django_settings
from pytest_django import Settings

from celery_orphans import leases, store
from celery_orphans.conf import settings as orphans_settings
from celery_orphans.leases import fresh_boots
from celery_orphans.store import Keys
from celery_orphans.worker import heartbeat as heartbeats
from celery_orphans.worker.heartbeat import Heartbeat

MakeBeat = Callable[..., Heartbeat]


def wait_for(condition: Callable[[], object], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


@pytest.fixture
def node() -> str:
    return f"celery@test-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def beat(redis_client: redis.Redis) -> Iterator[MakeBeat]:
    """Make heartbeats (read the settings in force at the call); every one is stopped afterwards."""
    made: list[Heartbeat] = []

    def make(node: str, *, boot: str | None = None) -> Heartbeat:
        made.append(Heartbeat(node, boot))
        return made[-1]

    yield make
    for heartbeat in made:
        heartbeat.stop()
    heartbeats.stop()


@pytest.fixture
def short_lease(settings: Settings) -> Settings:
    """Leases that lapse in 0.5 s and are renewed every 0.1 s, so expiry is seen within a second."""
    settings.CELERY_ORPHANS_LEASE_SECONDS = 0.5
    settings.CELERY_ORPHANS_HEARTBEAT_SECONDS = 0.1
    return settings


@pytest.fixture
def own_clients(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A client cache of this test's own, so a client made for a changed URL does not outlive it."""
    clients: dict[str, redis.Redis] = {}
    monkeypatch.setattr(store, "_clients", clients)
    yield
    for found in clients.values():
        found.close()


def lease_key(heartbeat: Heartbeat) -> str:
    return Keys.current().lease(heartbeat.node, heartbeat.boot)


def boots_of(redis_client: redis.Redis, node: str) -> set[str]:
    return {b.decode() for b in redis_client.hkeys(Keys.current().boots(node))}


# --- the lease ------------------------------------------------------------------------------------


def test_a_started_heartbeat_writes_its_lease_with_the_lease_expiry(
    beat: MakeBeat, redis_client: redis.Redis, node: str
) -> None:
    heartbeat = beat(node)
    heartbeat.start()

    lease_ms = orphans_settings.LEASE_SECONDS * 1000
    assert lease_ms - 1000 < redis_client.pttl(lease_key(heartbeat)) <= lease_ms
    value = json.loads(redis_client.get(lease_key(heartbeat)))
    assert value["node"] == node
    assert value["boot"] == heartbeat.boot
    assert value["pid"] == os.getpid()
    assert abs(value["renewed_at"] - time.time()) < 5
    assert boots_of(redis_client, node) == {heartbeat.boot}


def test_each_boot_gets_an_id_of_its_own(beat: MakeBeat, node: str) -> None:
    assert beat(node).boot != beat(node).boot
    assert beat(node, boot="given").boot == "given"


def test_entry_tokens_never_repeat_within_a_boot_or_across_boots(beat: MakeBeat, node: str) -> None:
    first, second = beat(node), beat(node)
    tokens = [first.token() for _ in range(1000)] + [second.token() for _ in range(1000)]
    assert len(set(tokens)) == 2000
    assert all(t.startswith(f"{first.boot}.") for t in tokens[:1000])


def test_fresh_boots_reports_every_live_boot_under_each_node(
    beat: MakeBeat, redis_client: redis.Redis, node: str
) -> None:
    first, second, elsewhere = beat(node), beat(node), beat(f"{node}-2")
    for heartbeat in (first, second, elsewhere):
        heartbeat.start()

    found = fresh_boots([node, f"{node}-2", "celery@nobody", node])

    assert found == {
        node: frozenset({first.boot, second.boot}),
        f"{node}-2": frozenset({elsewhere.boot}),
        "celery@nobody": frozenset(),
    }
    assert fresh_boots([]) == {}
    assert fresh_boots([node], redis_client) == {node: frozenset({first.boot, second.boot})}


def test_a_lease_that_is_not_renewed_lapses_on_its_own(
    beat: MakeBeat, redis_client: redis.Redis, short_lease: Settings, node: str
) -> None:
    short_lease.CELERY_ORPHANS_HEARTBEAT_SECONDS = 60  # started, but it will not beat again in this test
    stale, live = beat(node), beat(node)
    stale.start()
    live.start()
    assert fresh_boots([node])[node] == {stale.boot, live.boot}
    live.stop()
    started = time.monotonic()

    wait_for(lambda: not fresh_boots([node])[node], what="the lease to lapse")

    assert time.monotonic() - started < 5
    assert redis_client.exists(lease_key(stale)) == 0


def test_a_running_heartbeat_keeps_its_lease_alive_over_many_lease_periods(
    beat: MakeBeat, redis_client: redis.Redis, short_lease: Settings, node: str
) -> None:
    heartbeat = beat(node)
    heartbeat.start()
    first = json.loads(redis_client.get(lease_key(heartbeat)))["renewed_at"]
    seen: list[float] = []

    def renewed_long_after_the_first_lapse_would_have_happened() -> bool:
        assert fresh_boots([node])[node] == {heartbeat.boot}, "the lease lapsed while the heartbeat ran"
        seen.append(json.loads(redis_client.get(lease_key(heartbeat)))["renewed_at"])
        return seen[-1] > first + 4 * 0.5

    wait_for(renewed_long_after_the_first_lapse_would_have_happened, what="renewals over 4 lease periods")

    assert len(set(seen)) > 4  # renewed many times, not once


def test_stop_drops_the_lease_and_the_boot_at_once(
    beat: MakeBeat, redis_client: redis.Redis, node: str
) -> None:
    heartbeat, other = beat(node), beat(node)
    heartbeat.start()
    other.start()

    heartbeat.stop()

    assert redis_client.exists(lease_key(heartbeat)) == 0
    assert boots_of(redis_client, node) == {other.boot}
    assert fresh_boots([node])[node] == {other.boot}
    assert heartbeat._thread is not None
    assert not heartbeat._thread.is_alive()


def test_stop_without_start_drops_a_lease_written_by_renew(
    beat: MakeBeat, redis_client: redis.Redis, node: str
) -> None:
    heartbeat = beat(node)
    assert heartbeat.renew() is True

    heartbeat.stop()

    assert redis_client.exists(lease_key(heartbeat)) == 0
    assert boots_of(redis_client, node) == set()


def test_a_forked_child_gets_its_client_even_if_the_fork_caught_the_heartbeat_getting_one() -> None:
    store._clients_lock.acquire()  # as if the heartbeat's thread were in client() when the worker forked
    try:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = 0 if store.client().ping() else 2
            finally:
                os._exit(code)
    finally:
        store._clients_lock.release()

    assert exit_code_of(pid) == 0


def test_a_lapsed_boot_does_not_stay_listed_under_its_node(
    beat: MakeBeat, redis_client: redis.Redis, short_lease: Settings, node: str
) -> None:
    short_lease.CELERY_ORPHANS_HEARTBEAT_SECONDS = 60
    crashed = beat(node)
    crashed.renew()  # never stopped: as after SIGKILL
    wait_for(lambda: not fresh_boots([node])[node], what="the lease to lapse")

    assert crashed.boot not in boots_of(redis_client, node)


# --- telling a live twin from a boot killed a moment ago --------------------------------------------


def exit_code_of(pid: int, timeout: float = 10.0) -> int:
    deadline = time.monotonic() + timeout
    while (waited := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(f"the forked child {pid} did not exit")
        time.sleep(0.01)
    return os.waitstatus_to_exitcode(waited[1])


def test_renewals_reads_each_boots_current_lease_value(
    beat: MakeBeat, redis_client: redis.Redis, node: str
) -> None:
    heartbeat = beat(node)
    heartbeat.renew()

    values = leases.renewals(node, [heartbeat.boot, "never-was"])

    assert values == {heartbeat.boot: redis_client.get(lease_key(heartbeat)), "never-was": None}
    assert leases.renewals(node, []) == {}
    assert leases.renewals(node, [heartbeat.boot], redis_client) == {heartbeat.boot: values[heartbeat.boot]}


def test_renewed_within_reports_a_boot_that_keeps_beating(
    beat: MakeBeat, short_lease: Settings, node: str
) -> None:
    heartbeat = beat(node)
    heartbeat.start()
    started = time.monotonic()

    assert leases.renewed_within(node, [heartbeat.boot], 5) == {heartbeat.boot}
    assert time.monotonic() - started < 2  # it answers at the first renewal, not at the deadline


def test_renewed_within_leaves_out_a_lease_that_stands_still(
    beat: MakeBeat, short_lease: Settings, node: str
) -> None:
    short_lease.CELERY_ORPHANS_LEASE_SECONDS = 30
    frozen = beat(node)  # its lease stays, unrenewed, as a process killed a moment ago leaves it
    frozen.renew()
    live = beat(node)
    live.start()

    assert leases.renewed_within(node, [frozen.boot, live.boot, "never-was"], 1) == {live.boot}


def test_renewed_within_does_not_wait_for_a_boot_whose_process_is_gone_from_this_host(
    beat: MakeBeat, redis_client: redis.Redis, short_lease: Settings, node: str
) -> None:
    short_lease.CELERY_ORPHANS_LEASE_SECONDS = 30
    pid = os.fork()
    if pid == 0:  # the child writes a lease under its own pid, then dies without stopping it
        code = 1
        try:
            code = 0 if Heartbeat(node, boot="dead").renew() else 2
        finally:
            os._exit(code)
    assert exit_code_of(pid) == 0
    assert json.loads(redis_client.get(Keys.current().lease(node, "dead")))["pid"] == pid
    started = time.monotonic()

    assert leases.renewed_within(node, ["dead"], 5) == frozenset()
    assert time.monotonic() - started < 1


@pytest.mark.parametrize(
    "lease",
    [
        pytest.param({"host": "elsewhere"}, id="written-on-another-host"),
        pytest.param({"pid": "own"}, id="written-by-this-process"),
        pytest.param({"pid": "not-a-pid"}, id="unreadable-pid"),
        pytest.param(None, id="not-json"),
    ],
)
def test_renewed_within_waits_out_a_lease_it_cannot_prove_dead(
    redis_client: redis.Redis, node: str, lease: dict[str, Any] | None
) -> None:
    value: dict[str, Any] = {"node": node, "boot": "b", "pid": 2**22 + 1, "host": socket.gethostname()}
    if lease is not None:
        value.update(lease)
        if value["pid"] == "own":
            value["pid"] = os.getpid()
    redis_client.set(Keys.current().lease(node, "b"), "{not json" if lease is None else json.dumps(value))
    started = time.monotonic()

    assert leases.renewed_within(node, ["b"], 0.5) == frozenset()
    assert time.monotonic() - started >= 0.5  # watched to the deadline, not dismissed


# --- one renewal ----------------------------------------------------------------------------------


def test_one_renewal_is_one_round_trip_of_one_set_and_one_hset(
    beat: MakeBeat, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch, node: str
) -> None:
    heartbeat = beat(node)  # not started: only the renewals below talk to Redis
    heartbeat.renew()  # connect first, so the count holds renewals only
    sent: list[bytes] = []
    original = redis.connection.AbstractConnection.send_packed_command

    def counting(self: Any, command: Any, check_health: bool = True) -> None:
        sent.append(b"".join(command) if isinstance(command, list) else bytes(command))
        original(self, command, check_health)

    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", counting)
    renewals = 5
    for _ in range(renewals):
        assert heartbeat.renew() is True
    monkeypatch.undo()

    assert len(sent) == renewals
    for payload in sent:
        assert re.findall(rb"\*\d+\r\n\$\d+\r\n([A-Z]+)\r\n", payload) == [b"SET", b"HSET"]


# --- processes ------------------------------------------------------------------------------------


def test_a_forked_child_never_renews_its_parents_lease(
    beat: MakeBeat, redis_client: redis.Redis, node: str
) -> None:
    heartbeat = beat(node)  # not started: forking a process that runs threads is unsafe
    assert heartbeat.renew() is True
    before = redis_client.get(lease_key(heartbeat))

    pid = os.fork()
    if pid == 0:  # the child: report through the exit code only, and never return into pytest
        code = 3
        try:
            renewed = heartbeat.renew()
            code = 1 if renewed else (0 if heartbeat._stop.is_set() else 2)
        finally:
            os._exit(code)

    code = exit_code_of(pid)

    assert code == 0, {1: "the child renewed", 2: "the child kept beating", 3: "the child raised"}.get(code)
    after = redis_client.get(lease_key(heartbeat))
    assert after == before  # not even rewritten with the same pid
    assert json.loads(after)["pid"] == os.getpid()
    assert heartbeat.renew() is True  # the parent still can


def test_start_twice_in_one_process_returns_the_same_heartbeat(
    beat: MakeBeat, redis_client: redis.Redis, node: str
) -> None:
    first = heartbeats.start(node)
    second = heartbeats.start(node)

    assert second is first
    assert heartbeats.current() is first
    assert boots_of(redis_client, node) == {first.boot}

    heartbeats.stop()

    assert heartbeats.current() is None
    assert redis_client.exists(lease_key(first)) == 0
    assert boots_of(redis_client, node) == set()


def test_no_heartbeat_is_current_before_start(beat: MakeBeat) -> None:
    heartbeats.stop()

    assert heartbeats.current() is None
    heartbeats.stop()  # stopping nothing is harmless


# --- Redis failures -------------------------------------------------------------------------------


def test_renew_survives_redis_being_unreachable_and_warns_once_per_outage(
    beat: MakeBeat,
    settings: Settings,
    own_clients: None,
    caplog: pytest.LogCaptureFixture,
    redis_client: redis.Redis,
    node: str,
) -> None:
    heartbeat = beat(node)
    caplog.set_level(logging.INFO, logger="celery_orphans.worker.heartbeat")

    def logged(level: int) -> list[str]:
        return [
            r.getMessage()
            for r in caplog.records
            if r.name == "celery_orphans.worker.heartbeat" and r.levelno == level
        ]

    settings.CELERY_ORPHANS_REDIS_URL = "redis://127.0.0.1:1/0"  # nothing listens on port 1
    assert [heartbeat.renew() for _ in range(5)] == [False] * 5
    assert len(logged(logging.WARNING)) == 1
    assert node in logged(logging.WARNING)[0]

    settings.CELERY_ORPHANS_REDIS_URL = django_settings.REDIS_URL
    assert heartbeat.renew() is True
    assert heartbeat.renew() is True
    assert len(logged(logging.INFO)) == 1
    assert redis_client.exists(lease_key(heartbeat)) == 1

    settings.CELERY_ORPHANS_REDIS_URL = "redis://127.0.0.1:1/0"
    assert heartbeat.renew() is False
    assert heartbeat.renew() is False
    assert len(logged(logging.WARNING)) == 2  # a new outage is reported again


def test_a_running_heartbeat_outlives_an_outage(
    beat: MakeBeat,
    short_lease: Settings,
    own_clients: None,
    caplog: pytest.LogCaptureFixture,
    redis_client: redis.Redis,
    node: str,
) -> None:
    heartbeat = beat(node)
    short_lease.CELERY_ORPHANS_REDIS_URL = "redis://127.0.0.1:1/0"
    with caplog.at_level(logging.WARNING, logger="celery_orphans.worker.heartbeat"):
        heartbeat.start()
        wait_for(lambda: heartbeat._failing, what="the heartbeat to meet the outage")

    short_lease.CELERY_ORPHANS_REDIS_URL = django_settings.REDIS_URL
    wait_for(
        lambda: redis_client.exists(lease_key(heartbeat)), what="the lease to be renewed after the outage"
    )

    assert heartbeat._thread is not None
    assert heartbeat._thread.is_alive()
    assert fresh_boots([node])[node] == {heartbeat.boot}
