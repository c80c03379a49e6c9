"""The prefork pool with spawned processes (``worker_pool_start_method = "spawn"``, billiard's default on
macOS): each pool process reads its worker's validity from the main process's memory, handed to it as it
starts (worker/handover.py). Real workers: healthy, and its main process frozen alone; a killed one and
one frozen whole are in test_pools.py with every other pool."""

from __future__ import annotations

from typing import Any

import pytest
from celery import current_app
from django_celery_results.models import TaskResult

from tests.faults import assert_no_overlap, main_frozen, overlap, quiet, report
from tests.helpers import started_on, starts, wait_for
from tests.workers import OWN_SWEEPS_ON, SPAWN, SPAWN_FLAGS

pytestmark = [
    pytest.mark.worker,
    pytest.mark.skipif(not SPAWN, reason="spawned pool processes are Celery 5.7's --pool-start-method"),
]


def doomed_and_watcher(workers: Any, name: str) -> Any:
    """A spawn worker on a queue of its own, and a watcher (fork) that takes that queue once told to."""
    workers.own_sweeps = OWN_SWEEPS_ON
    doomed = workers.start(f"spawn-{name}@test", queues=(name,), flags=SPAWN_FLAGS)
    workers.start(f"watcher-{name}@test")
    return doomed


def watch_queue(name: str) -> None:
    current_app.control.add_consumer(name, destination=[f"watcher-{name}@test"], reply=True, timeout=5)


def test_a_spawn_workers_recoverable_tasks_succeed(workers: Any) -> None:
    from demoapp.tasks import summarize

    worker = workers.start("spawn@test", concurrency=2, flags=SPAWN_FLAGS)
    results = [summarize.delay([i, 1], seconds=0.5) for i in range(4)]

    assert [r.get(timeout=60) for r in results] == [1, 2, 3, 4]
    assert [starts(r.id) for r in results] == [1] * 4
    assert set(
        TaskResult.objects.filter(task_id__in=[r.id for r in results]).values_list("status", flat=True)
    ) == {"SUCCESS"}
    log = worker.log()
    assert "SpawnPoolWorker" in log  # its pool processes were spawned, not forked
    assert "may not store its result" not in log  # no execution was refused as forfeit
    assert "gives up its boot" not in log  # the lease was kept through the spawned pool's start


def test_a_spawn_worker_whose_main_process_hangs_stops_its_pool_execution_before_it_is_recovered(
    workers: Any,
) -> None:
    from demoapp.tasks import tick

    doomed = doomed_and_watcher(workers, "hung")
    result = tick.apply_async((20,), {"every": 0.5}, queue="hung")
    started_on(result.id, "spawn-hung@test", timeout=60)
    watch_queue("hung")

    with main_frozen(doomed) as stopped:
        wait_for(lambda: len(overlap(result.id).executions) >= 2, 40, "the task to run again")
        found = quiet(result.id, stale=True)
    report(
        "spawn: main process frozen alone",
        recovered_after=found.started[found.executions[1]] - stopped,
        stale_effects=found.count,
        overlap_seconds=found.window,
    )
    assert_no_overlap(result.id)
