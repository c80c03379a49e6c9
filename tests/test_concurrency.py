"""Many sweeps at once over the same orphans, and a sweep whose process dies while it holds the lock.

Orphans come from ``tests/factories.py``: a STARTED row and a ledger entry for a node that never answers.
Sweeps start together behind a barrier, each on a database connection of its own, through the entry
points that run them in production: Beat's reconcile task, the management command, an operator's
recover-now (``sweep.run`` with the admin trigger and a selection) and a worker's boot sweep.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import threading
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.db import connection, transaction
from django.utils import timezone
from django_celery_results.models import TaskResult

from celery_orphans import sweep
from celery_orphans.decision import Action
from celery_orphans.exceptions import SweepLocked
from celery_orphans.ledger import Ledger
from celery_orphans.models import OrphanEvent, Trigger
from celery_orphans.recovery import broker
from celery_orphans.store import Keys, client
from celery_orphans.sweep import runner
from celery_orphans.sweep.values import BootScope
from celery_orphans.tasks import reconcile
from celery_orphans.worker.heartbeat import Heartbeat
from tests import factories
from tests.helpers import QUEUE, ROOT, database_url, published_ids, sweep_now, wait_for
from tests.test_locks import database_lock_only, database_locks_held

pytestmark = pytest.mark.django_db(transaction=True)

ORPHANS = 50


def beat() -> object:
    return reconcile.run()  # "locked" when another sweep holds the lock


def command() -> object:
    try:
        call_command("reconcile_orphan_tasks", stdout=io.StringIO())
    except CommandError as exc:
        if "another reconcile sweep holds the lock" not in str(exc):
            raise
        return "locked"
    return "swept"


def admin(ids: list[str]) -> Callable[[], object]:
    def recover_now() -> object:
        options = sweep.Options(
            trigger=Trigger.ADMIN,
            user="admin",
            grace_seconds=0,
            task_ids=frozenset(ids),
            acts=frozenset({Action.RECOVER}),
        )
        return sweep.run(options)

    return recover_now


def boot() -> object:
    """The boot sweep of a worker restarted under the orphans' node name."""
    scope = BootScope(factories.GHOST, uuid.uuid4().hex, timezone.now(), frozenset)
    return sweep.run(sweep.Options(trigger=Trigger.WORKER_BOOT, grace_seconds=0, boot=scope))


def together(sweeps: list[Callable[[], object]]) -> list[object]:
    """Start every sweep at the same moment, each in a thread with its own connection; their results."""
    barrier = threading.Barrier(len(sweeps))
    results: list[object] = [None] * len(sweeps)

    def run(i: int) -> None:
        try:
            barrier.wait(timeout=30)
            results[i] = sweeps[i]()
        except SweepLocked:
            results[i] = "locked"
        except BaseException as exc:
            results[i] = exc
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(sweeps))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a sweep never finished"
    return results


def assert_each_recovered_exactly_once(ids: list[str], redis_client: Any) -> None:
    recovered = Counter(OrphanEvent.objects.filter(action="recovered").values_list("task_id", flat=True))
    assert recovered == Counter(ids)
    # Besides the recoveries, only records of what did nothing: a sweep refused for the lock, a chosen task
    # another sweep had taken, a sweep that came after every orphan was recovered.
    assert not OrphanEvent.objects.exclude(action__in=["recovered", "refused", "nothing_to_do"]).exists()
    assert Ledger(client(), Keys.current()).attempts(ids) == dict.fromkeys(ids, 1)
    assert published_ids(redis_client) == Counter(ids)
    assert redis_client.llen(QUEUE) == ORPHANS
    assert set(TaskResult.objects.filter(task_id__in=ids).values_list("status", flat=True)) == {"RETRY"}


@pytest.fixture
def orphans(redis_client: Any, settings: Any) -> list[str]:
    settings.CELERY_ORPHANS_INSPECT_TIMEOUT_SECONDS = 0.3  # the orphans' node never answers
    return [factories.orphan(started_ago=600 - i) for i in range(ORPHANS)]


def mix(n: int, ids: list[str]) -> list[Callable[[], object]]:
    kinds = [beat, command, admin(ids), boot]
    return [kinds[i % len(kinds)] for i in range(n)]


@pytest.mark.parametrize("n", [4, 8])
def test_concurrent_sweeps_recover_each_orphan_exactly_once(
    n: int, orphans: list[str], redis_client: Any
) -> None:
    results = together(mix(n, orphans))

    assert not [r for r in results if isinstance(r, BaseException)], results
    assert any(r != "locked" for r in results), results
    assert "locked" in results, results  # they did overlap: the lock turned some away
    sweep.run(sweep.Options(trigger=Trigger.BEAT))  # whatever the lock turned away is picked up now
    assert_each_recovered_exactly_once(orphans, redis_client)


def unlocked() -> Any:
    # As if the lock had failed (the Redis lock used on SQLite expires after
    # locks.REDIS_LOCK_SECONDS under a slow sweep): each sweep still runs in a transaction of its own.
    return transaction.atomic()


@pytest.mark.parametrize("n", [4, 8])
def test_without_the_lock_concurrent_sweeps_still_recover_each_orphan_exactly_once(
    n: int, orphans: list[str], redis_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runner, "sweep_lock", unlocked)

    results = together(mix(n, orphans))

    assert not [r for r in results if isinstance(r, BaseException)], results
    assert "locked" not in results, results
    sweep.run(sweep.Options(trigger=Trigger.BEAT))  # what a claim turned away was committed by then
    assert_each_recovered_exactly_once(orphans, redis_client)


@pytest.mark.skipif(
    connection.vendor == "sqlite",
    reason="SQLite runs one write transaction at a time: no sweep looks between another's claim and commit",
)
def test_a_sweep_that_looks_between_anothers_claim_and_commit_does_not_send_the_task_again(
    redis_client: Any, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings.CELERY_ORPHANS_INSPECT_TIMEOUT_SECONDS = 0.05
    task_id = factories.orphan()
    monkeypatch.setattr(runner, "sweep_lock", unlocked)
    publish = broker.publish
    second: dict[str, Any] = {}

    def publish_then_let_another_sweep_look(*args: Any, **kwargs: Any) -> None:
        publish(*args, **kwargs)
        if "thread" in second:
            return
        # The first sweep has claimed and sent the task and not yet committed: a second one looks now.
        second["thread"] = threading.Thread(target=lambda: second.update(result=together([sweep_now])[0]))
        second["thread"].start()
        wait_for(
            lambda: "result" in second or Ledger(client(), Keys.current()).attempts([task_id])[task_id] > 1,
            20,
            "the second sweep to claim the task or give up",
        )

    monkeypatch.setattr(broker, "publish", publish_then_let_another_sweep_look)

    first = sweep_now()
    second["thread"].join(timeout=30)

    assert first.count(Action.RECOVER, done_only=True) == 1
    assert not isinstance(second.get("result"), BaseException), second
    assert published_ids(redis_client) == Counter({task_id: 1})
    assert Ledger(client(), Keys.current()).attempts([task_id]) == {task_id: 1}


# --- a lock holder that dies -----------------------------------------------------------------------


@database_lock_only
def test_lock_held_by_a_sweep_process_that_is_killed_mid_sweep_is_released(
    orphans: list[str], redis_client: Any, settings: Any
) -> None:
    # A task only a result row knows of, on a node whose lease is fresh but which never answers: the holder
    # waits a minute for that node's reply while it holds the lock, and is killed meanwhile.
    settings.CELERY_ORPHANS_LEASE_SECONDS = 300
    Heartbeat("silent@test", boot="silent-boot").renew()
    factories.orphan(worker="silent@test", entry=False)
    environ = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "testproject.test_settings",
        "DATABASE_URL": database_url(),
        "CELERY_ORPHANS_INSPECT_TIMEOUT_SECONDS": "60",
        "CELERY_ORPHANS_SWEEP_STALL_SECONDS": "120",  # above the wait, or the check E009 refuses it
        "CELERY_ORPHANS_LEASE_SECONDS": "300",
    }
    holder = subprocess.Popen(
        [sys.executable, "testproject/manage.py", "reconcile_orphan_tasks"],
        cwd=ROOT,
        env=environ,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(database_locks_held, 90, "the holder to take the lock")
        with pytest.raises(SweepLocked):
            sweep.run(sweep.Options(trigger=Trigger.BEAT))
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=10)
    finally:
        if holder.poll() is None:
            holder.kill()

    wait_for(lambda: not database_locks_held(), 30, "the database to release the dead holder's lock")
    report = sweep.run(sweep.Options(trigger=Trigger.BEAT))

    assert report.count(Action.RECOVER, done_only=True) == ORPHANS
    assert_each_recovered_exactly_once(orphans, redis_client)
