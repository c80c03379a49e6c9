"""The Beat-scheduled reconcile task: switched off, idle, locked out, and acting."""

from __future__ import annotations

import logging
import re
import threading
import uuid
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone
from django_celery_results.models import TaskResult

from celery_orphans import tasks
from celery_orphans.models import OrphanEvent
from celery_orphans.sweep.lock import sweep_lock
from celery_orphans.tasks import reconcile

DISABLED_LINE = "celery-orphans: CELERY_ORPHANS_ENABLED is off; the reconcile task does nothing"
IDLE_SUMMARY = re.compile(
    r"^recovered 0 orphaned tasks, marked 0 terminal, forgotten 0 finished, 0 alive or in grace, "
    r"0 unreadable \(\d+\.\d\ds\)$"
)


@pytest.fixture(autouse=True)
def fresh_task_state(monkeypatch):
    # The task remembers across calls that it already said it is off; each test starts from a new process.
    monkeypatch.setattr(tasks, "_said_disabled", False)


def said_disabled(caplog) -> int:
    return [(r.name, r.getMessage()) for r in caplog.records].count(("celery_orphans.tasks", DISABLED_LINE))


def test_task_is_registered_under_its_stable_name_without_storing_results(celery_app):
    task = celery_app.tasks["celery_orphans.reconcile"]
    assert task.name == "celery_orphans.reconcile"
    assert task.ignore_result is True


def test_disabled_task_does_nothing_and_says_so_once(settings, caplog):
    settings.CELERY_ORPHANS_ENABLED = False

    with caplog.at_level(logging.INFO, logger="celery_orphans"):
        results = [reconcile() for _ in range(4)]

    assert results == ["disabled"] * 4
    assert said_disabled(caplog) == 1


@pytest.mark.django_db
def test_disabled_task_says_so_again_after_it_was_switched_back_on(settings, caplog, redis_client):
    with caplog.at_level(logging.INFO, logger="celery_orphans"):
        settings.CELERY_ORPHANS_ENABLED = False
        reconcile()
        reconcile()
        settings.CELERY_ORPHANS_ENABLED = True
        assert IDLE_SUMMARY.match(reconcile())
        settings.CELERY_ORPHANS_ENABLED = False
        assert reconcile() == "disabled"

    assert said_disabled(caplog) == 2


@pytest.mark.django_db
def test_enabled_task_with_nothing_orphaned_returns_the_summary(settings, caplog, redis_client):
    settings.CELERY_ORPHANS_ENABLED = True
    TaskResult.objects.create(task_id=str(uuid.uuid4()), task_name="demoapp.summarize", status="SUCCESS")

    with caplog.at_level(logging.INFO, logger="celery_orphans"):
        summary = reconcile()

    assert IDLE_SUMMARY.match(summary), summary
    assert said_disabled(caplog) == 0
    assert not OrphanEvent.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_task_returns_locked_while_another_sweep_holds_the_lock(settings, caplog, redis_client):
    settings.CELERY_ORPHANS_ENABLED = True
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        try:
            with sweep_lock():
                holding.set()
                release.wait(timeout=30)
        finally:
            connection.close()

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert holding.wait(timeout=10)
        with caplog.at_level(logging.DEBUG, logger="celery_orphans"):
            assert reconcile() == "locked"
    finally:
        release.set()
        holder.join(timeout=10)

    [locked] = [r for r in caplog.records if "another sweep holds the lock" in r.getMessage()]
    assert locked.levelno == logging.DEBUG  # routine: a worker's own sweeps hold it as Beat's arrives
    assert IDLE_SUMMARY.match(reconcile())


@pytest.mark.django_db(transaction=True)
def test_task_marks_an_orphan_of_a_vanished_worker_terminal_as_the_beat_trigger(settings, redis_client):
    import demoapp.tasks  # noqa: F401 - registers the task, as a worker's autodiscovery would

    settings.CELERY_ORPHANS_ENABLED = True
    task_id = str(uuid.uuid4())
    TaskResult.objects.create(
        task_id=task_id,
        task_name="demoapp.scan",
        status="STARTED",
        worker="vanished@test",
        date_started=timezone.now() - timedelta(hours=1),
    )

    summary = reconcile()

    assert summary.startswith("recovered 0 orphaned tasks, marked 1 terminal,"), summary
    assert TaskResult.objects.get(task_id=task_id).status == "FAILURE"
    audit = OrphanEvent.objects.get(task_id=task_id)
    assert (audit.action, audit.reason, audit.evidence, audit.trigger, audit.worker) == (
        "marked_terminal",
        "not_recoverable",
        "no_reply_no_lease",
        "beat",
        "vanished@test",
    )


def test_celerys_received_and_succeeded_lines_of_the_sweep_task_stay_out_of_the_log(caplog):
    from celery.app import trace

    line = {"id": "t", "return_value": "'recovered 0 ...'", "runtime": 0.01, "args": "()", "kwargs": "{}"}
    with caplog.at_level(logging.INFO):
        trace.info(trace.LOG_SUCCESS, {**line, "name": "celery_orphans.reconcile"})
        trace.info(trace.LOG_RECEIVED, {**line, "name": "celery_orphans.reconcile", "eta": None})
        trace.info(trace.LOG_SUCCESS, {**line, "name": "demoapp.summarize"})

    assert [r.getMessage().split("[")[0] for r in caplog.records] == ["Task demoapp.summarize"]


def test_beats_line_for_each_sweep_it_sends_stays_out_of_the_log(caplog):
    from celery import beat

    with caplog.at_level(logging.INFO):
        beat.info(
            "Scheduler: Sending due task %s (%s)", "celery-orphans: reconcile", "celery_orphans.reconcile"
        )
        beat.info("Scheduler: Sending due task %s (%s)", "nightly report", "demoapp.summarize")
        beat.error("Message Error: %s\n%s", "celery_orphans.reconcile", "a traceback")

    assert [r.getMessage().splitlines()[0] for r in caplog.records] == [
        "Scheduler: Sending due task nightly report (demoapp.summarize)",
        "Message Error: celery_orphans.reconcile",
    ]
