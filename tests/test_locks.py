"""One sweep at a time: the PostgreSQL advisory lock, the MySQL/MariaDB named lock, and the Redis lock used
elsewhere. The database's own locks are tested on whichever of the two the run uses (TEST_DATABASE_URL)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
from django.db import DatabaseError, OperationalError, connection, transaction

from celery_orphans.exceptions import SweepLocked
from celery_orphans.store import Keys
from celery_orphans.sweep import lock as locks
from celery_orphans.sweep.lock import ADVISORY_LOCK_ID, named_lock, sweep_lock
from tests.helpers import ROOT, database_url, wait_for

postgres_only = pytest.mark.skipif(
    connection.vendor != "postgresql", reason="the advisory lock exists only on PostgreSQL"
)
mysql_only = pytest.mark.skipif(
    connection.vendor != "mysql", reason="the named lock is MySQL's and MariaDB's"
)
database_lock_only = pytest.mark.skipif(
    connection.vendor not in {"postgresql", "mysql"}, reason="only PostgreSQL and MySQL/MariaDB hold the lock"
)


def in_thread(function: Callable[[], object]) -> object:
    """Run ``function`` in a new thread, on a database connection of its own; return or raise its result."""
    outcome: dict[str, object] = {}

    def target() -> None:
        try:
            outcome["value"] = function()
        except BaseException as exc:
            outcome["error"] = exc
        finally:
            connection.close()

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive(), "the other thread did not finish"
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["value"]


def lock_is_free_elsewhere() -> bool:
    """Whether another connection can take the sweep lock right now (it lets go at once)."""

    def attempt() -> bool:
        try:
            with sweep_lock():
                return True
        except SweepLocked:
            return False

    return bool(in_thread(attempt))


def hold_and_fail(free_while_held: list[bool]) -> None:
    """Take the lock, note whether another connection could take it too, then fail inside the block."""
    with sweep_lock():
        free_while_held.append(lock_is_free_elsewhere())
        raise ZeroDivisionError("the sweep failed part way")


def database_locks_held() -> int:
    """How many sessions hold the sweep's lock in this database (PostgreSQL's advisory lock, or the MySQL
    named lock)."""
    with connection.cursor() as cursor:
        if connection.vendor == "mysql":
            cursor.execute("SELECT IS_USED_LOCK(%s) IS NOT NULL", [named_lock(connection)])
            return int(cursor.fetchone()[0])
        cursor.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted"
            " AND (classid::bigint << 32) + objid::bigint = %s"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
            [ADVISORY_LOCK_ID],
        )
        (count,) = cursor.fetchone()
    return int(count)


@contextmanager
def held_in_thread() -> Iterator[threading.Event]:
    """Hold the sweep lock in another thread for the block; yields an event set once it has left its block."""
    holding, release, left = threading.Event(), threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def hold() -> None:
        try:
            with sweep_lock():
                holding.set()
                release.wait(timeout=30)
            left.set()
        except BaseException as exc:
            errors.append(exc)
            holding.set()
        finally:
            connection.close()

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        assert holding.wait(timeout=10), "the holder never took the lock"
        assert not errors, errors
        yield left
    finally:
        release.set()
        thread.join(timeout=10)
    assert not errors, errors


@database_lock_only
@pytest.mark.django_db(transaction=True)
def test_second_sweep_lock_is_refused_at_once_while_the_first_is_held():
    with held_in_thread() as left:
        with pytest.raises(SweepLocked, match="another reconcile sweep holds the lock"), sweep_lock():
            pytest.fail("took a lock that another connection holds")
        # Refused while the holder is still inside its block: the second caller did not wait for it.
        assert not left.is_set()

    assert lock_is_free_elsewhere()


@database_lock_only
@pytest.mark.django_db(transaction=True)
def test_lock_is_released_when_the_holders_block_ends():
    with sweep_lock():
        assert database_locks_held() == 1
        assert not lock_is_free_elsewhere()

    assert database_locks_held() == 0
    assert lock_is_free_elsewhere()


@database_lock_only
@pytest.mark.django_db(transaction=True)
def test_lock_is_released_when_the_holder_raises():
    free_while_held = []

    with pytest.raises(ZeroDivisionError):
        hold_and_fail(free_while_held)

    assert free_while_held == [False]
    assert lock_is_free_elsewhere()


@postgres_only
@pytest.mark.django_db(transaction=True)
def test_lock_taken_inside_an_outer_transaction_lasts_until_that_transaction_ends():
    with transaction.atomic():
        with sweep_lock():
            pass
        # A transaction-level lock: leaving the block releases only a savepoint, not the lock.
        assert not lock_is_free_elsewhere()

    assert lock_is_free_elsewhere()


@database_lock_only
@pytest.mark.django_db(transaction=True)
def test_lock_becomes_free_when_the_process_holding_it_is_killed():
    holder_code = (
        "import time, django\n"
        "django.setup()\n"
        "from celery_orphans.sweep.lock import sweep_lock\n"
        "with sweep_lock():\n"
        "    print('held', flush=True)\n"
        "    time.sleep(120)\n"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", holder_code],
        cwd=ROOT,
        env={
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "testproject.test_settings",
            "DATABASE_URL": database_url(),
            "PYTHONPATH": f"{ROOT}:{ROOT / 'testproject'}",
        },
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "held"
        assert database_locks_held() == 1
        assert not lock_is_free_elsewhere()

        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=10)

        # The server ends the dead client's session, and the lock with it, when the socket closes.
        wait_for(lock_is_free_elsewhere, 20, "the killed holder's lock to be released", interval=0.1)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(timeout=10)
        if holder.stdout is not None:
            holder.stdout.close()


def timeouts() -> tuple[str, str]:
    """This session's ``lock_timeout`` and ``idle_in_transaction_session_timeout``."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT current_setting('lock_timeout'), current_setting('idle_in_transaction_session_timeout')"
        )
        lock, idle = cursor.fetchone()
    return str(lock), str(idle)


@postgres_only
@pytest.mark.django_db(transaction=True)
def test_a_sweeps_own_transaction_bounds_its_waits_and_leaves_the_session_as_it_was(settings):
    settings.CELERY_ORPHANS_SWEEP_STALL_SECONDS = 1.5

    with sweep_lock():
        assert timeouts() == ("1500ms", "1500ms")

    assert timeouts() == ("0", "0")


@postgres_only
@pytest.mark.django_db(transaction=True)
def test_a_callers_transaction_keeps_its_own_timeouts(settings):
    settings.CELERY_ORPHANS_SWEEP_STALL_SECONDS = 1.5

    with transaction.atomic(), sweep_lock():
        assert timeouts() == ("0", "0")


def session_timeouts() -> tuple[int, int]:
    """This MySQL session's ``wait_timeout`` and ``innodb_lock_wait_timeout``."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT @@SESSION.wait_timeout, @@SESSION.innodb_lock_wait_timeout")
        wait, lock = cursor.fetchone()
    return int(wait), int(lock)


@mysql_only
@pytest.mark.django_db(transaction=True)
def test_a_sweeps_own_transaction_bounds_its_mysql_session_and_puts_it_back_after(settings):
    settings.CELERY_ORPHANS_SWEEP_STALL_SECONDS = 1.5
    before = session_timeouts()

    with sweep_lock():
        assert session_timeouts() == (2, 2)  # whole seconds, rounded up

    assert session_timeouts() == before
    assert before != (2, 2)


@mysql_only
@pytest.mark.django_db(transaction=True)
def test_a_callers_transaction_keeps_its_mysql_session_timeouts(settings):
    settings.CELERY_ORPHANS_SWEEP_STALL_SECONDS = 1.5
    before = session_timeouts()

    with transaction.atomic(), sweep_lock():
        assert session_timeouts() == before


@mysql_only
@pytest.mark.django_db(transaction=True)
def test_the_mysql_lock_is_let_go_only_after_the_sweeps_transaction_commits(monkeypatch):
    from django_celery_results.models import TaskResult

    seen_by_next: list[bool] = []
    original_release = locks._release_named_lock

    def release_after_looking(cursor: object, name: str) -> None:
        # What the next sweep finds once it can take the lock: everything this one committed.
        seen_by_next.append(bool(in_thread(lambda: TaskResult.objects.filter(task_id="committed").exists())))
        original_release(cursor, name)

    monkeypatch.setattr(locks, "_release_named_lock", release_after_looking)
    with sweep_lock():
        TaskResult.objects.create(task_id="committed", status="STARTED")

    assert seen_by_next == [True]
    assert database_locks_held() == 0


@database_lock_only
@pytest.mark.django_db(transaction=True)
def test_a_sweep_that_hangs_inside_its_transaction_loses_the_lock_to_the_next(settings):
    settings.CELERY_ORPHANS_SWEEP_STALL_SECONDS = 0.5
    errors: list[BaseException] = []
    holding, release = threading.Event(), threading.Event()

    def hang() -> None:
        try:
            with sweep_lock():
                holding.set()
                release.wait(timeout=30)  # stuck on something outside the database
        except BaseException as exc:
            errors.append(exc)
        finally:
            connection.close()

    thread = threading.Thread(target=hang)
    thread.start()
    try:
        assert holding.wait(timeout=10)
        assert not lock_is_free_elsewhere()
        wait_for(lock_is_free_elsewhere, 20, "PostgreSQL to end the hung sweep's transaction", interval=0.2)
    finally:
        release.set()
        thread.join(timeout=10)

    # When it wakes, the hung sweep learns that nothing it did was kept.
    assert len(errors) == 1 and isinstance(errors[0], DatabaseError), errors


@database_lock_only
@pytest.mark.django_db(transaction=True)
def test_a_sweep_gives_up_a_row_lock_another_transaction_keeps(settings):
    from django_celery_results.models import TaskResult

    settings.CELERY_ORPHANS_SWEEP_STALL_SECONDS = 0.5
    row = TaskResult.objects.create(task_id="held-row", status="STARTED")
    locked, release = threading.Event(), threading.Event()

    def keep_row_locked() -> None:
        with transaction.atomic():
            TaskResult.objects.select_for_update().get(pk=row.pk)
            locked.set()
            release.wait(timeout=30)

    thread = threading.Thread(target=lambda: (keep_row_locked(), connection.close()))
    thread.start()
    try:
        assert locked.wait(timeout=10)
        # PostgreSQL: "canceling statement due to lock timeout"; MySQL: "Lock wait timeout exceeded".
        with pytest.raises(OperationalError, match=r"(?i)lock (wait )?timeout"), sweep_lock():
            TaskResult.objects.filter(pk=row.pk).update(status="FAILURE")
    finally:
        release.set()
        thread.join(timeout=10)

    assert lock_is_free_elsewhere()


@pytest.fixture
def redis_lock(monkeypatch, redis_client):
    """Take the Redis path, as on a database without advisory locks."""
    monkeypatch.setattr(locks, "lock_kind", lambda using="default": "redis")
    return Keys.current().lock


@pytest.mark.django_db(transaction=True)
def test_redis_lock_refuses_a_second_holder_while_held(redis_lock, redis_client):
    with held_in_thread() as left:
        assert redis_client.exists(redis_lock)
        with pytest.raises(SweepLocked), sweep_lock():
            pytest.fail("took a lock that another holder has")
        assert not left.is_set()

    assert not redis_client.exists(redis_lock)
    assert lock_is_free_elsewhere()


@pytest.mark.django_db(transaction=True)
def test_redis_lock_expires_on_its_own_so_a_dead_holder_cannot_keep_it(redis_lock, redis_client):
    with sweep_lock():
        assert 0 < redis_client.pttl(redis_lock) <= locks.REDIS_LOCK_SECONDS * 1000


@pytest.mark.django_db(transaction=True)
def test_redis_lock_is_released_when_the_holder_raises(redis_lock, redis_client):
    free_while_held = []

    with pytest.raises(ZeroDivisionError):
        hold_and_fail(free_while_held)

    assert free_while_held == [False]
    assert not redis_client.exists(redis_lock)
    assert lock_is_free_elsewhere()


@database_lock_only
@pytest.mark.django_db(transaction=True)
def test_redis_lock_does_not_touch_the_database_lock(redis_lock):
    with sweep_lock():
        assert database_locks_held() == 0
