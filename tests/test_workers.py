import signal

import pytest
from django_celery_results.models import TaskResult

from tests.helpers import wait_for


@pytest.mark.worker
def test_task_sent_to_a_started_worker_runs_and_its_started_row_names_that_worker(workers, celery_app):
    from demoapp.tasks import summarize

    worker = workers.start("fixture@test")
    result = summarize.delay([1, 2, 3], seconds=1.0)

    row = wait_for(
        lambda: TaskResult.objects.filter(task_id=result.id, status="STARTED").first(), 15, "STARTED row"
    )
    assert row.worker == "fixture@test"
    assert result.get(timeout=15) == 6
    worker.stop(signal.SIGTERM)
    assert not worker.is_running()


@pytest.mark.worker
def test_sigkill_stops_the_worker_and_its_pool(workers):
    worker = workers.start("victim@test", concurrency=2)
    worker.kill()
    assert worker.process.returncode == -signal.SIGKILL
