"""Every execution pool: a task on a killed worker runs again once; a worker frozen past its lease stores
nothing over the recovered run. Real workers, SIGKILL and SIGSTOP. ``spawn`` is the prefork pool whose
processes are spawned (``worker_pool_start_method = "spawn"``, billiard's default on macOS)."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest
from celery import current_app
from django_celery_results.models import TaskResult

from celery_orphans.models import OrphanEvent
from tests.helpers import finishes, started_on, starts, summarize_on_a_doomed_worker, wait_for
from tests.workers import OWN_SWEEPS_ON, SPAWN, SPAWN_FLAGS

pytestmark = pytest.mark.worker

POOLS = ["prefork", *SPAWN, "solo", "threads", "gevent", "eventlet"]


def started_as(pool: str) -> dict[str, Any]:
    """How ``workers.start`` starts a worker of ``pool``."""
    if pool == "spawn":
        return {"pool": "prefork", "flags": SPAWN_FLAGS}
    return {"pool": pool}


def recovery_of(task_id: str) -> OrphanEvent:
    return wait_for(lambda: OrphanEvent.objects.filter(task_id=task_id).first(), 30, f"{task_id} recovered")


@pytest.mark.parametrize("pool", POOLS)
def test_a_task_on_a_killed_worker_runs_again_once_on_another(workers: Any, pool: str) -> None:
    doomed, result = summarize_on_a_doomed_worker(workers, pool, seconds=3, **started_as(pool))

    doomed.kill()

    event = recovery_of(result.id)
    assert (event.action, event.evidence) == ("recovered", "process_exited")
    assert result.get(timeout=30) == 5
    assert TaskResult.objects.get(task_id=result.id).worker == f"watcher-{pool}@test"
    assert (starts(result.id), finishes(result.id)) == (2, 1)


@pytest.mark.parametrize("pool", POOLS)
def test_a_worker_frozen_past_its_lease_stores_nothing_over_the_recovered_run(
    workers: Any, pool: str
) -> None:
    from demoapp.tasks import stored, summarize

    workers.own_sweeps = {
        **OWN_SWEEPS_ON,
        "CELERY_ORPHANS_HEARTBEAT_SECONDS": "0.5",
        "CELERY_ORPHANS_LEASE_SECONDS": "2",
    }
    frozen = workers.start(f"frozen-{pool}@test", queues=(pool,), **started_as(pool))
    workers.start("watcher@test")
    result = summarize.apply_async(([6],), {"seconds": 5}, queue=pool)
    started_on(result.id, f"frozen-{pool}@test", timeout=60)
    current_app.control.add_consumer(pool, destination=["watcher@test"], reply=True, timeout=5)
    os.killpg(frozen.pid, signal.SIGSTOP)
    try:
        event = recovery_of(result.id)
        assert (event.action, event.evidence) == ("recovered", "lease_lapsed")
        wait_for(lambda: stored(result.id) == 1, 30, "the recovered run to finish")
    finally:
        os.killpg(frozen.pid, signal.SIGCONT)

    wait_for(lambda: "gives up its boot" in frozen.log(), 20, "the thawed worker to give its boot up")
    # On solo and threads the thawed body runs to its end; only what Celery does with its outcome is
    # refused. Its body takes 5 s: wait it out. Prefork's pool process and gevent's greenlet are killed.
    stopped = pool in ("prefork", "spawn", "gevent", "eventlet")
    wait_for(lambda: stopped or finishes(result.id) >= 2, 20, "the thawed body to end")
    assert finishes(result.id) == (1 if stopped else 2)
    row = TaskResult.objects.get(task_id=result.id)
    assert (row.status, row.worker, stored(result.id)) == ("SUCCESS", "watcher@test", 1)
