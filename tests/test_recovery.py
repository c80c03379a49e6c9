"""End-to-end recovery with real workers, real Redis, PostgreSQL and SIGKILL."""

from __future__ import annotations

import pytest
from django_celery_results.models import TaskResult

from celery_orphans import sweep
from celery_orphans.models import OrphanEvent, Trigger
from celery_orphans.reconcile import Action, Evidence
from tests.workers import wait_for

pytestmark = pytest.mark.worker


def started_on(task_id: str, worker: str, timeout: float = 20) -> TaskResult:
    return wait_for(
        lambda: TaskResult.objects.filter(task_id=task_id, status="STARTED", worker=worker).first(),
        timeout, f"{task_id} STARTED on {worker}",
    )


def sweep_now(**kwargs: object) -> sweep.Report:
    return sweep.run(sweep.Options(trigger=Trigger.COMMAND, grace_seconds=0, **kwargs))


def test_killed_worker_restarted_under_same_name_runs_the_task_again_with_the_same_id(workers):
    from demoapp.tasks import runs, summarize

    worker = workers.start("same@test")
    result = summarize.delay([1, 2, 3], seconds=3)
    started_on(result.id, "same@test")
    worker.kill()
    workers.start("same@test")

    report = sweep_now()

    [outcome] = [o for o in report.outcomes if o.decision.task_id == result.id]
    assert outcome.done and outcome.decision.action is Action.RECOVER
    assert outcome.decision.evidence is Evidence.WORKER_ANSWERED_WITHOUT_TASK
    assert result.get(timeout=30) == 6
    assert TaskResult.objects.get(task_id=result.id).status == "SUCCESS"
    events = runs(result.id)
    assert [e.split(":")[0] for e in events] == ["start", "start", "finish"]
    audit = OrphanEvent.objects.get(task_id=result.id)
    assert (audit.action, audit.attempt, audit.worker) == ("recovered", 1, "same@test")
