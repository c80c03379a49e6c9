"""No live task is ever recovered: busy solo workers, busy loops, a paused Redis, a cut broker link.

The workers run with their own sweeps on (at boot, and the watch's), as in production.
"""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
from django.db import connection

from celery_orphans import sweep
from celery_orphans.decision import Action, Evidence
from celery_orphans.exceptions import SweepLocked
from celery_orphans.models import OrphanEvent, Trigger
from celery_orphans.store import Keys
from tests.helpers import finishes, outcome_of, started_on, starts, wait_for
from tests.workers import OWN_SWEEPS_ON

pytestmark = pytest.mark.worker


@pytest.fixture(autouse=True)
def production_workers(workers):
    """Workers with their own sweeps on, as in production, and one more worker beside the tested one:
    its heartbeat watches the tested worker's lease and process, and would sweep if it saw them gone."""
    workers.own_sweeps = OWN_SWEEPS_ON
    workers.start("bystander@test", queues=("bystander",))
    return workers


def sweep_unlocked() -> sweep.Report | None:
    """One sweep of the test's own, or ``None`` while a worker's own sweep holds the lock."""
    with contextlib.suppress(SweepLocked):
        return sweep.run(sweep.Options(trigger=Trigger.COMMAND, grace_seconds=0))
    return None


def sweep_while(condition: object, every: float = 1.0) -> list[sweep.Report]:
    reports = []
    while condition():  # type: ignore[operator]
        with contextlib.suppress(SweepLocked):  # a worker's own sweep: its outcomes are audited too
            reports.append(sweep.run(sweep.Options(trigger=Trigger.COMMAND, grace_seconds=0)))
        time.sleep(every)
    return reports


def assert_never_acted(reports: list[sweep.Report], task_id: str) -> None:
    acted = [o for r in reports for o in r.outcomes if o.decision.task_id == task_id and o.done]
    assert not acted, acted
    # A copy the broker delivered again while the task ran may have been dropped: nothing else happened.
    assert not OrphanEvent.objects.exclude(action="duplicate_dropped").exists()


def test_solo_worker_running_a_sixty_second_task_is_never_recovered(workers):
    from demoapp.tasks import summarize

    workers.start("solo60@test", pool="solo")
    result = summarize.delay([6], seconds=60)
    started_on(result.id, "solo60@test")

    reports = sweep_while(lambda: not result.ready(), every=2.0)

    assert len(reports) >= 20
    assert_never_acted(reports, result.id)
    assert result.get(timeout=5) == 6 and starts(result.id) == 1


@pytest.mark.parametrize("pool", ["solo", "prefork"])
def test_task_spinning_in_a_tight_loop_for_thirty_seconds_is_never_recovered(workers, pool):
    from demoapp.tasks import spin

    workers.start(f"spin-{pool}@test", pool=pool)
    result = spin.delay(30)
    started_on(result.id, f"spin-{pool}@test")

    reports = sweep_while(lambda: not result.ready(), every=2.0)

    assert_never_acted(reports, result.id)
    assert result.get(timeout=5) > 0 and starts(result.id) == 1


def test_redis_paused_for_five_seconds_during_sweeps_recovers_nothing(workers, redis_client):
    from demoapp.tasks import summarize

    # The defaults: a lease of five heartbeats outlives the pause (a 2 s test lease would not).
    workers.start(
        "pause@test",
        pool="solo",
        env={"CELERY_ORPHANS_HEARTBEAT_SECONDS": "2", "CELERY_ORPHANS_LEASE_SECONDS": "10"},
    )
    result = summarize.delay([5], seconds=15)
    started_on(result.id, "pause@test")
    reports: list[sweep.Report] = []

    def sweeps() -> None:
        try:
            reports.extend(sweep_while(lambda: not result.ready(), 0.5))
        finally:
            connection.close()

    sweeper = threading.Thread(target=sweeps)
    sweeper.start()
    time.sleep(1)
    redis_client.execute_command("CLIENT", "PAUSE", 5000, "ALL")
    sweeper.join(timeout=60)

    assert len(reports) >= 3
    assert_never_acted(reports, result.id)
    assert result.get(timeout=5) == 5 and starts(result.id) == 1


def test_worker_whose_broker_connections_are_cut_and_restored_is_not_recovered(workers, redis_client):
    from demoapp.tasks import summarize

    worker = workers.start("cut@test")
    result = summarize.delay([3], seconds=12)
    started_on(result.id, "cut@test")
    # Every connection to this suite's Redis database but this test's own Redis clients: the worker's,
    # and the test's broker link (other databases belong to other work on the machine).
    mine = {str(redis_client.client_id())}
    db = str(redis_client.connection_pool.connection_kwargs.get("db", 0))
    for client in redis_client.client_list():
        if client["db"] == db and client["id"] not in mine and client.get("name") != "celery-orphans":
            redis_client.client_kill_filter(_id=client["id"])
    wait_for(
        lambda: "Connected to redis" in worker.log().split("ready.")[-1] or result.ready(),
        20,
        "the worker to reconnect",
    )

    reports = sweep_while(lambda: not result.ready(), every=1.0)

    assert_never_acted(reports, result.id)
    assert result.get(timeout=20) == 3
    assert finishes(result.id) >= 1


def test_worker_whose_lease_vanished_is_not_judged_dead_while_its_last_renewal_holds(workers, redis_client):
    from demoapp.tasks import summarize

    # Beats far apart: once its lease is gone (deleted, evicted, lost in a failover), the worker does not
    # find out before the task ends; its last renewal holds for five minutes, three beats and the margin
    # (E008).
    env = {"CELERY_ORPHANS_HEARTBEAT_SECONDS": "100", "CELERY_ORPHANS_LEASE_SECONDS": "301"}
    workers.start("vanished@test", env=env)
    result = summarize.delay([4], seconds=6)
    started_on(result.id, "vanished@test")
    redis_client.delete(*redis_client.keys(Keys.current().lease("vanished@test", "*")))

    # The bystander's watch may see the lease gone and sweep first (CI met its lock once): it must leave
    # the task alone as well, which the audit check below says.
    report = wait_for(sweep_unlocked, 20, "a sweep of the test's own", interval=0.2)

    decision = outcome_of(report, result.id).decision
    assert (decision.action, decision.evidence) == (Action.LEAVE, Evidence.BOOT_ALIVE)
    assert result.get(timeout=20) == 4 and starts(result.id) == 1
    assert not OrphanEvent.objects.exclude(action="duplicate_dropped").exists()  # no sweep acted
