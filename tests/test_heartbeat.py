"""Worker leases against a real Redis: the key a heartbeat keeps alive, what the sweep reads from it, and
a worker whose Redis is out of reach when it starts."""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from django.conf import settings as django_settings
from pytest_django import Settings

from celery_orphans.conf import settings as orphans_settings
from celery_orphans.leases import fresh_boots
from celery_orphans.store import Keys
from celery_orphans.worker import forfeit, lifecycle
from tests.helpers import MakeHeartbeat, boots_of, exit_code_of, lease_key, started_on, wait_for
from tests.services import RedisServer, TcpProxy
from tests.workers import WorkerPool


def test_a_started_heartbeat_writes_its_lease_with_the_lease_expiry(
    make_heartbeat: MakeHeartbeat, redis_client: redis.Redis, node: str
) -> None:
    heartbeat = make_heartbeat(node)
    heartbeat.start()

    lease_ms = orphans_settings.LEASE_SECONDS * 1000
    assert lease_ms - 1000 < redis_client.pttl(lease_key(heartbeat)) <= lease_ms
    value = json.loads(redis_client.get(lease_key(heartbeat)))
    assert value["node"] == node
    assert value["boot"] == heartbeat.boot
    assert value["pid"] == os.getpid()
    assert abs(value["renewed_at"] - time.time()) < 5
    assert boots_of(redis_client, node) == {heartbeat.boot}


def test_each_boot_gets_an_id_of_its_own(make_heartbeat: MakeHeartbeat, node: str) -> None:
    assert make_heartbeat(node).boot != make_heartbeat(node).boot
    assert make_heartbeat(node, boot="given").boot == "given"


def test_entry_tokens_never_repeat_within_a_boot_or_across_boots(
    make_heartbeat: MakeHeartbeat, node: str
) -> None:
    first, second = make_heartbeat(node), make_heartbeat(node)
    tokens = [first.token() for _ in range(1000)] + [second.token() for _ in range(1000)]
    assert len(set(tokens)) == 2000
    assert all(t.startswith(f"{first.boot}.") for t in tokens[:1000])


def test_a_running_heartbeat_keeps_its_lease_alive_over_many_lease_periods(
    make_heartbeat: MakeHeartbeat, redis_client: redis.Redis, short_lease: Settings, node: str
) -> None:
    heartbeat = make_heartbeat(node)
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
    make_heartbeat: MakeHeartbeat, redis_client: redis.Redis, node: str
) -> None:
    heartbeat, other = make_heartbeat(node), make_heartbeat(node)
    heartbeat.start()
    other.start()

    heartbeat.stop()

    assert redis_client.exists(lease_key(heartbeat)) == 0
    assert boots_of(redis_client, node) == {other.boot}
    assert fresh_boots([node])[node] == {other.boot}
    assert heartbeat._thread is not None
    assert not heartbeat._thread.is_alive()


def test_stop_without_start_drops_a_lease_written_by_renew(
    make_heartbeat: MakeHeartbeat, redis_client: redis.Redis, node: str
) -> None:
    heartbeat = make_heartbeat(node)
    assert heartbeat.renew() is True

    heartbeat.stop()

    assert redis_client.exists(lease_key(heartbeat)) == 0
    assert boots_of(redis_client, node) == set()


def test_one_renewal_is_one_round_trip_of_script_calls_alone(
    make_heartbeat: MakeHeartbeat, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch, node: str
) -> None:
    heartbeat = make_heartbeat(node)  # not started: only the renewals below talk to Redis
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
    calls = [b"EVALSHA"] * (2 if heartbeat.presence is not None else 1)  # the lease's, its presence's
    for payload in sent:
        assert re.findall(rb"\*\d+\r\n\$\d+\r\n([A-Z]+)\r\n", payload) == calls


def test_a_forked_child_never_renews_its_parents_lease(
    make_heartbeat: MakeHeartbeat, redis_client: redis.Redis, node: str
) -> None:
    heartbeat = make_heartbeat(node)  # not started: forking a process that runs threads is unsafe
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


def test_take_twice_in_one_process_returns_the_same_heartbeat(
    make_heartbeat: MakeHeartbeat, redis_client: redis.Redis, node: str
) -> None:
    first = lifecycle.take(node)
    first.start()
    second = lifecycle.take(node)

    assert second is first
    assert lifecycle.current() is first
    assert boots_of(redis_client, node) == {first.boot}

    lifecycle.stop()

    assert lifecycle.current() is None
    assert redis_client.exists(lease_key(first)) == 0
    assert boots_of(redis_client, node) == set()


def test_no_heartbeat_is_current_before_start(make_heartbeat: MakeHeartbeat) -> None:
    lifecycle.stop()

    assert lifecycle.current() is None
    lifecycle.stop()  # stopping nothing is harmless


def test_renew_survives_redis_being_unreachable_and_warns_once_per_outage(
    make_heartbeat: MakeHeartbeat,
    settings: Settings,
    own_clients: None,
    caplog: pytest.LogCaptureFixture,
    redis_client: redis.Redis,
    node: str,
) -> None:
    heartbeat = make_heartbeat(node)
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
    make_heartbeat: MakeHeartbeat,
    short_lease: Settings,
    own_clients: None,
    caplog: pytest.LogCaptureFixture,
    redis_client: redis.Redis,
    node: str,
) -> None:
    heartbeat = make_heartbeat(node)
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


# --- a ledger out of reach when the worker starts -------------------------------------------------

UNREACHABLE = "redis://:pw-s3cret@127.0.0.1:1/0"  # nothing listens on port 1


def records(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name.startswith("celery_orphans") and r.levelno == level
    ]


def test_while_no_lease_holds_the_tries_back_off_to_one_heartbeat(
    make_heartbeat: MakeHeartbeat,
    settings: Settings,
    own_clients: None,
    caplog: pytest.LogCaptureFixture,
    node: str,
) -> None:
    settings.CELERY_ORPHANS_HEARTBEAT_SECONDS = 2
    settings.CELERY_ORPHANS_LEASE_SECONDS = 10
    settings.CELERY_ORPHANS_REDIS_URL = UNREACHABLE
    heartbeat = make_heartbeat(node)

    assert heartbeat.take() is False
    waits = [heartbeat._until_next()]
    for _ in range(4):
        assert heartbeat.renew() is False
        waits.append(heartbeat._until_next())
    heartbeat.stop()  # no lease of its own to drop

    assert waits == [0.25, 0.5, 1.0, 2.0, 2.0]
    assert not heartbeat.leased
    # Not started: nothing said yet (start() says it once); the failed tries and the stop say nothing.
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_a_heartbeat_that_cannot_reach_its_ledger_says_so_once_and_takes_its_lease_when_it_answers(
    make_heartbeat: MakeHeartbeat,
    settings: Settings,
    own_clients: None,
    caplog: pytest.LogCaptureFixture,
    redis_client: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
    node: str,
) -> None:
    settings.CELERY_ORPHANS_REDIS_URL = UNREACHABLE
    heartbeat = make_heartbeat(node)
    tries = []
    write = heartbeat._write
    monkeypatch.setattr(heartbeat, "_write", lambda *a, **kw: tries.append(1) or write(*a, **kw))
    taken: list[bool] = []
    caplog.set_level(logging.INFO, logger="celery_orphans")

    assert heartbeat.take() is False
    heartbeat.when_taken(lambda: taken.append(heartbeat.leased))
    assert records(caplog, logging.ERROR) == []  # said once the worker's logging is set up: at start()
    heartbeat.start()
    wait_for(lambda: len(tries) >= 4, what="the heartbeat to try again, and again")
    assert not heartbeat.leased and taken == []
    assert not forfeit.holds(heartbeat.generation)

    settings.CELERY_ORPHANS_REDIS_URL = django_settings.REDIS_URL
    wait_for(lambda: heartbeat.leased, what="the lease to be taken once Redis answers")

    assert redis_client.exists(lease_key(heartbeat)) == 1
    assert forfeit.holds(heartbeat.generation)
    # The thread runs what waited for the lease just after it publishes the lease's validity.
    wait_for(lambda: taken, what="what waited for the lease to run")
    assert taken == [True]
    [error] = records(caplog, logging.ERROR)
    assert error.startswith(f"celery-orphans: worker {node} cannot reach its ledger's Redis at 127.0.0.1:1 (")
    assert "it holds no lease" in error and "pw-s3cret" not in error
    assert records(caplog, logging.WARNING) == []
    [info] = records(caplog, logging.INFO)
    assert info.startswith(
        f"celery-orphans: lease of {node} (boot {heartbeat.boot}) taken: its ledger answered"
    )


def test_the_lease_of_a_heartbeat_taken_at_once_runs_what_waits_for_it_at_once(
    make_heartbeat: MakeHeartbeat, node: str
) -> None:
    heartbeat = make_heartbeat(node)
    assert heartbeat.take() is True
    taken: list[bool] = []
    heartbeat.when_taken(lambda: taken.append(heartbeat.leased))
    assert taken == [True]


@pytest.mark.worker
@pytest.mark.parametrize("hold", [pytest.param(None, id="held"), pytest.param("0", id="no-hold")])
def test_a_worker_that_cannot_reach_its_ledger_at_start_holds_or_runs_tasks_unrecorded_then_records_them(
    workers: WorkerPool, redis_client: redis.Redis, tmp_path: Path, hold: str | None
) -> None:
    """A worker without a lease cannot record a delivery: with the default ``LEDGER_HOLD_SECONDS`` it gives
    the message back to the broker unrun until its lease is taken, and runs it recorded then; with 0 (the
    old rule, fail open at once) it runs it unrecorded at once."""
    from demoapp.tasks import add, summarize

    ledger = RedisServer(tmp_path / "ledger", password="pw-s3cret").start()
    proxy = TcpProxy(ledger.port)  # the worker's way to its ledger, closed at first
    proxy.cut()
    env = {
        "CELERY_ORPHANS_REDIS_URL": f"redis://:pw-s3cret@127.0.0.1:{proxy.port}/0",
        "CELERY_ORPHANS_BOOT_SWEEP": "true",
        "CELERY_ORPHANS_HEARTBEAT_SECONDS": "4",
        "CELERY_ORPHANS_LEASE_SECONDS": "13",
        **({"CELERY_ORPHANS_LEDGER_HOLD_SECONDS": hold} if hold is not None else {}),
    }
    try:
        worker = workers.start("unledgered@test", env=env)

        def quiet_after_a_try_that_followed_a_pause() -> bool:
            # The tries back off (0.25, 0.5, 1, 2 s apart, then a heartbeat): after a 2 s pause the next
            # comes 4 s later, so a task sent now is admitted while Redis answers and no lease holds.
            tried = list(proxy.refused)
            paused = any(b - a >= 1.9 for a, b in itertools.pairwise(tried))
            return paused and time.monotonic() - tried[-1] > 1.0

        wait_for(quiet_after_a_try_that_followed_a_pause, 30, "the worker's tries to back off")
        proxy.restore()
        unrecorded = add.delay(2, 3)
        assert unrecorded.get(timeout=15) == 5
        wait_for(lambda: "unledgered@test (boot" in worker.log() and "taken: its ledger" in worker.log(), 15)
        log = worker.log()
        ran = log.index(f"demoapp.add[{unrecorded.id}] succeeded")
        if hold is None:
            # Received with no lease: given back to the broker unrun, and run once the lease was taken.
            assert "cannot record deliveries in the ledger (its worker holds no lease)" in log
            assert log.index("taken: its ledger") < ran
        else:
            # Admitted with no lease: it ran unrecorded, with no generation stamped on it that does not hold.
            assert ran < log.index("taken: its ledger")
        # Held, it ran recorded, and its entry went with its acknowledgement; unheld, it had none.
        wait_for(lambda: not ledger.client().exists(Keys.current().entry(unrecorded.id)), 5, "no entry left")

        recorded = summarize.delay([1, 2], seconds=3)
        started_on(recorded.id, "unledgered@test")
        assert ledger.client().exists(Keys.current().entry(recorded.id))  # under the lease now
        assert recorded.get(timeout=20) == 3
        wait_for(lambda: not ledger.client().exists(Keys.current().entry(recorded.id)), 5, "its release")
    finally:
        workers.close()  # first: a worker whose ledger goes away as it stops says it cannot renew
        proxy.close()
        ledger.stop()

    log = worker.log()
    # One line, in Celery's log (the test project's own handler prints each celery-orphans line again).
    said = "ERROR/MainProcess] celery-orphans: worker unledgered"
    [said] = [line for line in log.splitlines() if said in line]
    assert f"cannot reach its ledger's Redis at 127.0.0.1:{proxy.port} (" in said
    for noise in ("pw-s3cret", "Traceback", "Exception in thread", "cannot renew", "cannot record demoapp"):
        assert noise not in log
