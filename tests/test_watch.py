"""The watch: every renewal sees lapsed leases and the processes on its machine; a worker that sees a boot
gone sweeps at once. With a real Redis, real processes, and real workers killed and frozen."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import pytest
import redis
from celery import current_app
from django_celery_results.models import TaskResult
from pytest_django import Settings

from celery_orphans import leases, processes
from celery_orphans.leases import Seen, fresh_boots
from celery_orphans.models import OrphanEvent
from celery_orphans.store import Keys
from celery_orphans.sweep.watch import Watch
from tests.helpers import (
    MakeHeartbeat,
    boots_of,
    finishes,
    lease_key,
    lease_of_exited_process,
    started_on,
    starts,
    wait_for,
)
from tests.workers import OWN_SWEEPS_ON


def watch_members(redis_client: redis.Redis) -> set[str]:
    return {m.decode() for m in redis_client.zrange(Keys.current().watch, 0, -1)}


# --- what a renewal sees ----------------------------------------------------------------------------


def test_a_renewal_reports_the_boots_whose_lease_lapsed_never_its_own(
    make_heartbeat: MakeHeartbeat, short_lease: Settings, node: str
) -> None:
    stale = make_heartbeat(node)
    stale.renew()  # once, and never again: as after SIGKILL
    wait_for(lambda: not fresh_boots([node], prune=False)[node], what="the lease to lapse")
    seen: list[Seen] = []
    watcher = make_heartbeat(f"{node}-watcher", on_renewed=seen.append)

    watcher.renew()
    watcher.renew()

    assert [s.lapsed for s in seen] == [[(node, stale.boot)], [(node, stale.boot)]]


def test_of_the_workers_that_saw_a_lease_lapse_one_claims_it_and_none_claims_a_live_one(
    make_heartbeat: MakeHeartbeat, redis_client: redis.Redis, short_lease: Settings, node: str
) -> None:
    stale, live = make_heartbeat(node), make_heartbeat(node)
    stale.renew()
    live.start()
    wait_for(lambda: fresh_boots([node], prune=False)[node] == {live.boot}, what="the lease to lapse")

    assert [leases.claim_lapsed(node, stale.boot), leases.claim_lapsed(node, stale.boot)] == [True, False]
    assert not leases.claim_lapsed(node, live.boot)
    assert watch_members(redis_client) == {leases.member(node, live.boot)}


def test_a_renewal_reports_the_other_boots_on_its_machine_with_their_processes(
    make_heartbeat: MakeHeartbeat, node: str
) -> None:
    pid = lease_of_exited_process(node, "gone")
    seen: list[Seen] = []
    watcher = make_heartbeat(f"{node}-watcher", on_renewed=seen.append)

    watcher.renew()

    [(seen_node, seen_boot, process)] = seen[0].neighbours
    assert (seen_node, seen_boot, process.pid) == (node, "gone", pid)
    assert processes.exited(process)
    assert seen[0].lapsed == []  # its lease is still alive: only its process tells


def test_an_exit_is_recorded_once_and_then_the_boot_is_gone_exited_and_off_the_watch(
    make_heartbeat: MakeHeartbeat, redis_client: redis.Redis, node: str
) -> None:
    lease_of_exited_process(node, "gone")
    seen: list[Seen] = []
    make_heartbeat(f"{node}-watcher", on_renewed=seen.append).renew()
    [(_, _, process)] = seen[0].neighbours

    assert [leases.record_exit(node, "gone", process), leases.record_exit(node, "gone", process)] == [
        True,
        False,
    ]
    states = leases.boot_states([node], prune=False)[node]
    assert (states.alive, states.gone, states.exited) == (frozenset(), {"gone"}, {"gone"})
    assert not redis_client.exists(Keys.current().lease(node, "gone"))
    assert leases.member(node, "gone") not in watch_members(redis_client)


def test_a_boot_that_stops_leaves_nothing_behind_to_watch(
    make_heartbeat: MakeHeartbeat, redis_client: redis.Redis, node: str
) -> None:
    heartbeat = make_heartbeat(node)
    heartbeat.start()
    assert watch_members(redis_client) == {leases.member(node, heartbeat.boot)}

    heartbeat.stop()

    here = processes.this()
    assert here is not None
    assert watch_members(redis_client) == set()
    assert not redis_client.hexists(Keys.current().machine(here.machine), leases.member(node, heartbeat.boot))
    assert not redis_client.exists(lease_key(heartbeat)) and boots_of(redis_client, node) == set()


def test_a_renewal_without_a_watch_reads_nothing_back(
    make_heartbeat: MakeHeartbeat, short_lease: Settings, node: str
) -> None:
    stale = make_heartbeat(node)
    stale.renew()
    wait_for(lambda: not fresh_boots([node])[node], what="the lease to lapse")

    assert make_heartbeat(f"{node}-2")._write(first=True) == Seen()


# --- real workers ------------------------------------------------------------------------------------


@pytest.mark.worker
@pytest.mark.parametrize(
    "timings",
    [
        {},
        # Renewals too far apart to be what saw it within the wait: the kernel told the live worker.
        {"CELERY_ORPHANS_HEARTBEAT_SECONDS": "60", "CELERY_ORPHANS_LEASE_SECONDS": "300"},
    ],
    ids=["default", "renewals_a_minute_apart"],
)
def test_a_worker_killed_beside_a_live_one_is_recovered_by_that_ones_watch(
    workers: Any, timings: dict[str, str]
) -> None:
    from demoapp.tasks import summarize

    workers.own_sweeps = {**OWN_SWEEPS_ON, **timings}  # and no Beat, and no sweep of the test's own
    doomed = workers.start("doomed@test", queues=("doomed",))
    workers.start("watcher@test")
    result = summarize.apply_async(([1, 2],), {"seconds": 3}, queue="doomed")
    started_on(result.id, "doomed@test")
    current_app.control.add_consumer("doomed", destination=["watcher@test"], reply=True, timeout=5)

    doomed.kill()

    event = wait_for(lambda: OrphanEvent.objects.filter(task_id=result.id).first(), 30, "the recovery")
    assert (event.action, event.trigger, event.evidence) == ("recovered", "watch", "process_exited")
    assert result.get(timeout=30) == 3
    assert TaskResult.objects.get(task_id=result.id).worker == "watcher@test"
    assert (starts(result.id), finishes(result.id)) == (2, 1)


@pytest.mark.worker
def test_a_frozen_worker_is_recovered_by_a_live_workers_watch_once_its_lease_lapses(workers: Any) -> None:
    from demoapp.tasks import stored, summarize

    workers.own_sweeps = {
        **OWN_SWEEPS_ON,
        "CELERY_ORPHANS_HEARTBEAT_SECONDS": "0.5",
        "CELERY_ORPHANS_LEASE_SECONDS": "2",
    }
    frozen = workers.start("frozen@test", queues=("frozen",))
    workers.start("watcher@test")
    result = summarize.apply_async(([6],), {"seconds": 6}, queue="frozen")
    started_on(result.id, "frozen@test")
    current_app.control.add_consumer("frozen", destination=["watcher@test"], reply=True, timeout=5)
    os.killpg(frozen.pid, signal.SIGSTOP)  # its process lives: only its lease can tell
    try:
        event = wait_for(lambda: OrphanEvent.objects.filter(task_id=result.id).first(), 30, "the recovery")
        assert (event.action, event.trigger, event.evidence) == ("recovered", "watch", "lease_lapsed")
        wait_for(lambda: stored(result.id) == 1, 30, "the recovered run to finish")
    finally:
        os.killpg(frozen.pid, signal.SIGCONT)

    wait_for(lambda: "gives up its boot" in frozen.log(), 20, "the thawed worker to give its boot up")
    row = TaskResult.objects.get(task_id=result.id)
    assert (row.status, row.worker, stored(result.id)) == ("SUCCESS", "watcher@test", 1)


class CountedWatch(Watch):
    """A watch whose sweep is held until the test lets it go, and counted."""

    def __init__(self) -> None:
        super().__init__(None)
        self.began = threading.Semaphore(0)
        self.go_on = threading.Event()
        self.swept = 0

    def _sweep_once(self) -> None:
        self.swept += 1
        self.began.release()
        self.go_on.wait(10)


def test_a_sweep_asked_for_while_one_runs_runs_once_more_after_it_however_often_it_was_asked():
    watch = CountedWatch()

    watch.sweep()
    assert watch.began.acquire(timeout=10), "the first sweep to begin"
    watch.sweep()
    watch.sweep()
    watch.sweep()
    watch.go_on.set()

    assert watch.began.acquire(timeout=10), "the second sweep to begin"
    wait_for(lambda: not watch._running, 10, "the watch's sweeps to end")
    assert watch.swept == 2
