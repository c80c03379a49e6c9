"""The test workers themselves: a started worker runs tasks; SIGKILL takes its pool down with it."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from django_celery_results.models import TaskResult

from tests.helpers import wait_for
from tests.workers import Worker, process_tree


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


def alive(pid: int) -> bool:
    """Whether the process exists and is not a zombie waiting to be reaped."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return fields[0] not in ("Z", "X")


def pool_of(worker: Worker) -> list[int] | None:
    """The pids of the worker's pool processes, once both are up."""
    tree = process_tree(worker.pid)
    return tree[1:] if len(tree) == 3 else None


@pytest.mark.worker
def test_sigkill_stops_the_worker_and_its_pool(workers):
    worker = workers.start("victim@test", concurrency=2)
    pool = wait_for(lambda: pool_of(worker), 15, "the two pool processes")

    worker.kill()

    assert worker.process.returncode == -signal.SIGKILL
    wait_for(lambda: not any(alive(pid) for pid in pool), 10, "the pool processes to be gone")
