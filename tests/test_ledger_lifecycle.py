"""Whatever way a recoverable task ends, its ledger entry goes with it."""

from __future__ import annotations

import pytest
from celery.exceptions import TimeLimitExceeded
from django_celery_results.models import TaskResult

from celery_orphans.ledger import Ledger
from celery_orphans.store import Keys, client
from tests.helpers import boots_of, wait_for

pytestmark = pytest.mark.worker


def ledger() -> Ledger:
    return Ledger(client(), Keys.current())


def test_entry_exists_while_the_task_runs_and_names_this_worker_boot(workers, redis_client):
    from demoapp.tasks import summarize

    workers.start("life@test")
    result = summarize.delay([1], seconds=2)
    entry = wait_for(lambda: ledger().load([result.id])[result.id], 15, "the ledger entry")
    assert entry.node == "life@test" and entry.task_name == "demoapp.summarize"
    assert {entry.boot} == boots_of(redis_client, "life@test")  # the boot whose lease the worker holds
    assert entry.delivery.headers["id"] == result.id
    assert result.get(timeout=15) == 1
    # Removed just after the acknowledgement, which follows the result: by the worker's next ledger
    # write, or within a moment when no task follows.
    wait_for(lambda: ledger().load([result.id])[result.id] is None, 5, "the entry to be removed")


def test_no_entry_is_left_after_success_failure_retry_revoke_and_time_limit(workers, celery_app):
    from demoapp.tasks import fail, overrun, retry_once, summarize

    workers.start("life@test", concurrency=2)
    done = summarize.delay([2])
    failed = fail.delay()
    retried = retry_once.delay()
    timed_out = overrun.delay(5)
    revoked_running = summarize.delay([3], seconds=30)
    wait_for(
        lambda: TaskResult.objects.filter(task_id=revoked_running.id, status="STARTED").exists(),
        15,
        "the long task to start",
    )
    celery_app.control.revoke(revoked_running.id, terminate=True)

    assert done.get(timeout=15) == 2
    with pytest.raises(ValueError, match="always fails"):
        failed.get(timeout=15)
    assert retried.get(timeout=15) == 1
    with pytest.raises(TimeLimitExceeded):
        timed_out.get(timeout=15)
    wait_for(
        lambda: TaskResult.objects.filter(task_id=revoked_running.id, status="REVOKED").exists(),
        15,
        "the revoke to land",
    )
    wait_for(lambda: ledger().count() == 0, 10, "the ledger to empty")
    assert client().keys(f"{Keys.current().prefix}:entry:*") == []
