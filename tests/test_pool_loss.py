"""A pool process that dies under a recoverable task: recovered by its own worker, and capped."""

from __future__ import annotations

import pytest

from celery_orphans.exceptions import RecoveryLimitReached
from celery_orphans.models import OrphanEvent
from tests.helpers import starts

pytestmark = pytest.mark.worker


def test_task_whose_pool_process_dies_once_is_sent_again_by_the_worker_itself(workers):
    from demoapp.tasks import lose_pool_process

    workers.start("oom@test")
    result = lose_pool_process.delay(times=1)

    assert result.get(timeout=30) == "survived"
    assert starts(result.id) == 2
    [event] = OrphanEvent.objects.filter(task_id=result.id)
    assert (event.action, event.evidence, event.trigger, event.attempt) == (
        "recovered",
        "pool_child_lost",
        "worker",
        1,
    )


def test_task_that_kills_its_pool_process_every_time_stops_after_max_attempts(workers):
    from demoapp.tasks import lose_pool_process

    workers.start("oom@test")
    result = lose_pool_process.delay()  # @recoverable(max_attempts=2)

    with pytest.raises(RecoveryLimitReached):
        result.get(timeout=40)
    assert starts(result.id) == 3
    assert list(
        OrphanEvent.objects.filter(task_id=result.id).order_by("id").values_list("action", flat=True)
    ) == ["recovered", "recovered", "marked_terminal"]
