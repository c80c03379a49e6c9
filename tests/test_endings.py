"""Executions that end without a state (endings.py): Ignore, Task.replace() and Reject, on real workers.

That nothing is done to them on a healthy fleet is the no-harm suite's to show (tests/test_no_harm.py);
here, what becomes of a replacement whose worker dies, and what the sweep makes of the rows they leave.
"""

from __future__ import annotations

import pytest
from celery import Celery
from django_celery_results.models import TaskResult

from celery_orphans import endings
from celery_orphans.decision import Action
from celery_orphans.models import OrphanEvent
from celery_orphans.store import Keys, client
from tests.helpers import sweep_until, wait_for

pytestmark = pytest.mark.worker
INCLUDE = ("demoapp.noharm",)


def test_a_replacement_whose_worker_dies_is_recovered_under_the_callers_id(workers):
    from demoapp.noharm import replace_me, runs

    doomed = workers.start("doomed@test", include=INCLUDE)
    result = replace_me.delay("chain", 3.0)  # step(1) | step(): the last step carries the caller's id
    wait_for(
        lambda: TaskResult.objects.filter(
            task_id=result.id, task_name="noharm.step", status="STARTED"
        ).exists(),
        30,
        "the replacement's last task to start",
    )
    doomed.kill()
    workers.start("rescuer@test", include=INCLUDE)

    outcome = sweep_until(result.id, Action.RECOVER)

    assert outcome.decision.evidence.value in {"process_exited", "lease_lapsed"}
    assert result.get(timeout=30) == 3
    assert [r["name"] for r in runs(result.id)] == ["noharm.replace_me", "noharm.step", "noharm.step"]
    assert list(OrphanEvent.objects.values_list("task_id", "action")) == [(result.id, "recovered")]


def test_the_ending_of_an_ignored_task_is_recorded_by_the_pool_process(workers, celery_app: Celery):
    from demoapp.noharm import ignore

    workers.start("ignoring@test", include=INCLUDE)
    result = ignore.delay()

    found = wait_for(
        lambda: endings.read(client(), Keys.current(), [result.id]).get(result.id), 20, "the ending's record"
    )

    assert found.node == "ignoring@test"
    row = TaskResult.objects.get(task_id=result.id)
    assert row.status == "STARTED" and found.covers(row.worker, row.date_started)
    ttl = client().ttl(f"{Keys.current().prefix}:ended:{result.id}")
    assert 0 < ttl <= celery_app.conf.result_expires.total_seconds()
