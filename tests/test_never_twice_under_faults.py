"""Never twice under the faults a real network, a real Redis and real clocks produce: connections that go dark
without closing, a main process that hangs while its pool runs on, a Redis that refuses writes, clocks that
jump or stand still, and the races found by reading the worker's code.

Real workers with the suite's short lease (tests/faults.py has the toolkit). Each test measures its fault's
window and prints it (``report``; FAULTS_REPORT=file.jsonl collects the figures). A test marked
``faults`` shows a fault not withstood yet: it runs only with ``-m faults`` or CELERY_ORPHANS_FAULTS=1.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from django_celery_results.models import TaskResult

from celery_orphans.conf import FORFEIT_LATENCY_SECONDS
from celery_orphans.conf import settings as orphans_settings
from celery_orphans.decision import Action
from celery_orphans.ledger import Ledger, ledger_for
from celery_orphans.models import OrphanEvent
from celery_orphans.recovery import broker
from celery_orphans.store import Keys, client
from tests.faults import (
    SteppedClock,
    assert_no_overlap,
    effects,
    freeze,
    main_frozen,
    overlap,
    pool_processes,
    quiet,
    report,
    report_no_overlap,
    seen_in_log,
    thaw,
)
from tests.helpers import (
    finishes,
    ledger_env,
    started_on,
    starts,
    sweep_now,
    sweep_until,
    task_on_a_doomed_worker,
    wait_for,
)
from tests.services import RedisServer, TcpProxy
from tests.workers import process_tree

pytestmark = pytest.mark.worker
HEARTBEAT = float(os.environ["CELERY_ORPHANS_HEARTBEAT_SECONDS"])  # the suite's (test_settings.py)
LEASE = float(os.environ["CELERY_ORPHANS_LEASE_SECONDS"])
# A worker told to consume a queue takes it into its BRPOP (kombu's Redis transport) once the one under way
# times out, within a second: nothing to poll for.
LISTENING = 1.5


def tick_on(queue: str, seconds: float, every: float = 0.5) -> Any:
    from demoapp.tasks import tick

    return tick.apply_async((seconds,), {"every": every}, queue=queue)


def recovered(task_id: str, timeout: float = 40) -> float:
    """Wait until a second execution of ``task_id`` acts; when it started (Redis's clock)."""
    wait_for(lambda: len(overlap(task_id).executions) >= 2, timeout, f"{task_id} to run again")
    stats = overlap(task_id)
    return stats.started[stats.executions[1]]


def run_port(redis_client: Any) -> int:
    return int(redis_client.connection_pool.connection_kwargs["port"])


# --- connections that go dark, a main process that hangs ----------------------------------------------


def test_a_worker_whose_ledger_connection_goes_dark_stops_its_execution_before_it_is_recovered(
    workers: Any, redis_client: Any
) -> None:
    proxy = TcpProxy(run_port(redis_client))
    try:
        # Its ledger alone behind the proxy: its broker, and what the task does, stay reachable.
        doomed, result = task_on_a_doomed_worker(
            workers, "dark", lambda q: tick_on(q, 30), doomed_env=ledger_env(proxy)
        )
        proxy.blackhole()
        cut = time.time()
        again = recovered(result.id)
        gave_up = seen_in_log(doomed, "gives up its boot", 60)
        found = quiet(result.id, stale=True)
    finally:
        proxy.close()

    report_no_overlap(
        "blackholed ledger", result.id, found, recovered_after=again - cut, gave_up_after=gave_up - cut
    )


def test_a_worker_whose_main_process_hangs_stops_its_pool_execution_before_it_is_recovered(
    workers: Any,
) -> None:
    doomed, result = task_on_a_doomed_worker(workers, "hung", lambda q: tick_on(q, 20))

    with main_frozen(doomed) as stopped:
        again = recovered(result.id)
        # As long as a main process may hang in a blocking call; the test lets it go after 5 s.
        time.sleep(max(0.0, again + 5 - time.time()))
    thawed = time.time()
    found = quiet(result.id, stale=True)

    report_no_overlap(
        "main process frozen alone",
        result.id,
        found,
        recovered_after=again - stopped,
        thawed_after_recovery=thawed - again,
    )


# --- a ledger that refuses writes ------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["oom", "readonly"])
def test_tasks_arriving_while_the_ledger_refuses_writes_each_end_success_once(
    workers: Any, ledger_redis: RedisServer, settings: Any, how: str
) -> None:
    from demoapp.tasks import summarize

    settings.CELERY_ORPHANS_INSPECT_TIMEOUT_SECONDS = 1.0  # a live worker here: let it answer
    workers.own_sweeps = {"CELERY_ORPHANS_BOOT_SWEEP": "true", "CELERY_ORPHANS_WATCH": "true"}
    workers.start("refused@test", env=ledger_env(ledger_redis), concurrency=3)
    results = []
    refusing = restored = 0.0
    begun = time.monotonic()
    for i in range(24):  # one a second; writes refused from the 2nd second to the 22nd
        if i == 2:
            ledger_redis.refuse_writes(how)
            refusing = time.monotonic()
            # Received before the worker's renewal meets the refusal, and still running when its boot
            # is given up: its entry was sent without waiting, and refused.
            results.append(summarize.delay([i], seconds=4))
        if i == 22:
            ledger_redis.accept_writes()
            restored = time.monotonic()
        results.append(summarize.delay([i], seconds=0.5))
        if i == 1:
            # Recorded, and still running when its boot is given up: recovered once writes come back.
            results.append(summarize.delay([i], seconds=4))
        time.sleep(max(0.0, begun + i + 1 - time.monotonic()))
    # Then Beat's sweeps, one every 2 s, for 20 s.
    for _ in range(10):
        last = sweep_now()
        time.sleep(2)

    ids = [r.id for r in results]
    rows = dict(TaskResult.objects.filter(task_id__in=ids).values_list("task_id", "status"))
    status = Counter(rows.get(i, "PENDING") for i in ids)
    finished = Counter(finishes(i) for i in ids)
    report(
        f"ledger refusing writes ({how})",
        refused_for=restored - refusing,
        tasks=len(ids),
        success=status["SUCCESS"],
        left_started=status["STARTED"],
        finished_once=finished[1],
        finished_twice_or_more=sum(n for k, n in finished.items() if k > 1),
        started_again=sum(1 for i in ids if starts(i) > 1),
        last_sweep=str(
            dict(Counter(f"{o.decision.action.value}:{o.decision.reason.value}" for o in last.outcomes))
        ),
        statuses=str(dict(status)),
    )
    assert (status["SUCCESS"], finished[1]) == (len(ids), len(ids)), (dict(status), dict(finished))


# --- clocks ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("step", [pytest.param(30, id="ahead"), pytest.param(-30, id="behind")])
def test_a_task_on_a_killed_worker_whose_wall_clock_was_stepped_is_recovered_once_like_any_other(
    workers: Any, tmp_path: Path, step: int
) -> None:
    clock = SteppedClock(tmp_path / "clock")
    clock.step_wall(step)  # before the delivery: the entry and the row carry the stepped time
    workers.own_sweeps = {"CELERY_ORPHANS_BOOT_SWEEP": "true", "CELERY_ORPHANS_WATCH": "true"}
    doomed, result = task_on_a_doomed_worker(
        workers, "stepped", lambda q: tick_on(q, 8), doomed_env=clock.env()
    )
    # Its row says STARTED before the body acts: killed before its first side effect, it would leave no
    # execution to count (as a loaded CI machine showed).
    wait_for(lambda: effects(result.id), 20, "the body's first side effect")
    # The worker is alive: whatever its clock says, its task is left alone.
    assert not [o for o in sweep_now().outcomes if o.done]

    doomed.kill()
    killed = time.time()

    def recovery_sent() -> bool:
        # As Beat would, besides the watcher's own sweep (sweep_now waits while that one holds the lock).
        sweep_now()
        return len(overlap(result.id).executions) >= 2

    wait_for(recovery_sent, 60, "the task to run again", interval=1)
    again = overlap(result.id).started[overlap(result.id).executions[1]]
    report(f"wall clock {step:+d} s on a killed worker", recovered_after_kill=again - killed)
    assert again - killed < 10
    assert result.get(timeout=30) > 0
    assert starts(result.id) == 2


@pytest.mark.parametrize("how", ["suspended", "stopped", "paused_vm"])
def test_a_worker_stopped_or_suspended_stores_nothing_and_acts_no_more_once_its_task_was_recovered(
    workers: Any, tmp_path: Path, redis_client: Any, how: str
) -> None:
    from demoapp.tasks import stored

    clock = SteppedClock(tmp_path / "clock")
    doomed, result = task_on_a_doomed_worker(
        workers, "suspended", lambda q: tick_on(q, 4), doomed_env=clock.env()
    )
    # Stop it (its main process and its pool) as its body nears its end: at its 8th and last side effect,
    # 0.5 s before it, within the heartbeat interval the main process sleeps after a resume. (A sleep
    # here to come nearer the end let the body end first under load.)
    wait_for(lambda: any(e.seq == 7 for e in effects(result.id)), 10, "the body to near its end", 0.01)
    processes = process_tree(doomed.pid)
    freeze(processes)
    stopped = time.time()
    again = recovered(result.id)
    time.sleep(1)
    slept = time.time() - stopped
    if how in ("suspended", "paused_vm"):  # CLOCK_MONOTONIC did not advance while the host slept
        clock.step_monotonic(-slept)
    if how == "paused_vm":  # nor did CLOCK_BOOTTIME while the hypervisor held the guest
        clock.step_boottime(-slept)
    # The heartbeat thread sleeps out the rest of its interval on that clock after a suspend, so the main
    # process is resumed an interval after the pool (a SIGCONT would wake its timed wait at once).
    thaw([pid for pid in processes if pid != doomed.pid])
    resumed = time.time()
    time.sleep(HEARTBEAT)
    thaw([doomed.pid])
    seen_in_log(doomed, "gives up its boot", 10)
    found = quiet(result.id)  # every execution, the recovered one too, ended
    wait_for(lambda: stored(result.id) >= 1, 10, "the recovered run's outcome")
    stale_pids = {str(pid) for pid in processes}
    stored_by = [
        line.decode().split(":")[0] for line in redis_client.lrange(f"demo:stored:{result.id}", 0, -1)
    ]

    acted_after_resume = max((e.at - resumed for e in found.stale), default=0.0)
    report(
        how.replace("_", " ") + " worker",
        recovered_after=again - stopped,
        stale_effects=found.count,
        overlap_seconds=found.window,
        acted_after_resume=acted_after_resume,
        stored=len(stored_by),
        stored_by_the_stale_execution=sum(1 for pid in stored_by if pid in stale_pids),
    )
    if how == "paused_vm":
        # No clock of a paused guest advanced: its executions hold, by their clocks, at most what was left
        # of their validity when it was paused, and its main process gives them up sooner at its first
        # renewal, which finds the lease gone (never-twice.md, "A paused virtual machine").
        assert acted_after_resume <= LEASE - orphans_settings.lease_margin() + FORFEIT_LATENCY_SECONDS, found
        return
    assert stored(result.id) == 1
    if how == "suspended":
        assert_no_overlap(result.id)
    # A stopped worker's execution may still act between the thaw and the check at its body's end or its
    # kill (never-twice.md, "What a body can still do"); a suspended one's must not outlive its validity.


# --- found by reading -------------------------------------------------------------------------------------


def test_a_task_that_requeues_itself_runs_again_when_another_worker_takes_the_message_at_once(
    workers: Any, redis_client: Any
) -> None:
    from demoapp.tasks import requeue_once

    proxy = TcpProxy(run_port(redis_client))
    try:
        # Its ledger slow (well within its lease): the reject puts the message back before the entry is
        # marked handed back, and the watcher takes it in between.
        _, result = task_on_a_doomed_worker(
            workers, "requeue", lambda q: requeue_once.apply_async(kwargs={"seconds": 2}, queue=q),
            doomed_env=ledger_env(proxy),
        )  # fmt: skip
        time.sleep(LISTENING)
        proxy.delay(400)
        wait_for(
            lambda: (
                TaskResult.objects.filter(task_id=result.id, status="SUCCESS").exists()
                or "dropped a duplicate" in workers.workers[1].log()
            ),
            20,
            "the requeued copy to run or be dropped",
        )
    finally:
        proxy.close()

    row = TaskResult.objects.get(task_id=result.id)
    report(
        "reject(requeue=True) ordering",
        starts=starts(result.id),
        status=row.status,
        dropped_as_duplicate=int("dropped a duplicate" in workers.workers[1].log()),
    )
    assert result.get(timeout=20) == "ran after a requeue"
    assert starts(result.id) == 2


def test_a_copy_delivered_again_while_its_worker_lease_key_is_gone_but_its_renewal_holds_is_dropped(
    workers: Any, celery_app: Any
) -> None:
    doomed, result = task_on_a_doomed_worker(workers, "evicted", lambda q: tick_on(q, 6, every=0.1))
    entry = Ledger(client(), Keys.current()).load([result.id])[result.id]
    assert entry is not None
    time.sleep(LISTENING)

    # The lease key goes (evicted, deleted by hand) while the worker's main process pauses for a second,
    # well within its lease; meanwhile the transport restores the unacknowledged message (as any worker's
    # boot or its periodic restore does), and the watcher takes it.
    with main_frozen(doomed):
        client().delete(Keys.current().lease(entry.node, entry.boot))
        with celery_app.connection_for_write() as conn:
            conn.default_channel.qos.restore_by_tag(entry.delivery.delivery_tag, leftmost=True)
        time.sleep(1)
    found = quiet(result.id)

    report(
        "admission trusts EXISTS lease",
        executions=len(found.executions),
        stale_effects=found.count,
        overlap_seconds=found.window,
    )
    assert_no_overlap(result.id)
    assert doomed.is_running()


@pytest.mark.parametrize(
    "concurrency",
    [pytest.param(2, id="copies-at-once"), pytest.param(1, id="second-copy-after-the-first-ended")],
)
def test_a_recovery_published_twice_runs_once(
    workers: Any, monkeypatch: pytest.MonkeyPatch, concurrency: int
) -> None:
    publish = broker.publish

    def publish_twice(*args: Any, **kwargs: Any) -> None:
        # A crash after the publish, or a publish retried after the broker took it.
        publish(*args, **kwargs)
        publish(*args, **kwargs)

    monkeypatch.setattr(broker, "publish", publish_twice)
    doomed = workers.start("twice-a@test")
    # Long enough to outlast the second worker's start: the task is still running when its worker dies.
    result = tick_on("celery", 8)
    started_on(result.id, "twice-a@test")
    workers.start("twice-b@test", concurrency=concurrency)
    doomed.kill()

    wait_for(lambda: [o for o in sweep_now().outcomes if o.done], 20, "the task to be recovered")
    time.sleep(2)
    found = quiet(result.id)
    report(
        f"recovery published twice ({concurrency} pool processes)",
        executions=len(found.executions),
        starts=starts(result.id),
    )
    assert starts(result.id) == 2


def test_an_ignore_result_task_that_ran_to_its_end_is_not_recovered(workers: Any, celery_app: Any) -> None:
    # Sent by name: importing the task here would put it before this process's checks (warning W004).
    worker = workers.start("fence@test", include=("demoapp.unrecorded",))
    result = celery_app.send_task("demoapp.fire", args=[1.0])
    wait_for(lambda: starts(result.id), 20, "the task to begin")
    time.sleep(0.5)
    # The body ends, and passes the fence check of its pool process, while the main process is stopped;
    # the main process acknowledges it only once the boot's lease may have lapsed.
    with main_frozen(worker):
        wait_for(lambda: finishes(result.id), 5, "the body to end")
        time.sleep(2.5)
    seen_in_log(worker, "gives up its boot", 10)
    # Beat's sweeps, past the grace: run by the worker, where the task is known.
    for _ in range(6):
        celery_app.send_task("celery_orphans.reconcile")
        time.sleep(1.5)
    time.sleep(2)
    recoveries = OrphanEvent.objects.filter(task_id=result.id, action="recovered").count()

    report("ignore_result: the ack after the fence", finishes=finishes(result.id), recoveries=recoveries)
    assert (finishes(result.id), recoveries) == (1, 0)


def test_a_job_handed_to_the_pool_before_its_worker_froze_does_not_start_once_its_boot_was_given_up(
    workers: Any,
) -> None:
    from demoapp.tasks import stored

    doomed = workers.start("handed@test", queues=("handed",))
    # Its pool process stopped first: the main process admits the delivery and hands it to the pool, where
    # it waits, unread, while the whole worker is frozen past its lease.
    pool = pool_processes(doomed)
    freeze(pool)
    result = tick_on("handed", 1)
    wait_for(lambda: ledger_for().load([result.id])[result.id], 10, "its delivery to be admitted")
    time.sleep(0.3)
    freeze([doomed.pid])
    processes = [doomed.pid, *pool]
    stopped = time.time()
    try:
        sweep_until(result.id, Action.RECOVER)  # another worker's sweep: its row says RETRY
        recovered_at = time.time()
    finally:
        thaw(processes)
    thawed = time.time()
    # Every state its row goes through until the recovered run ends, with the pid that wrote it.
    seen: list[tuple[str, object]] = []

    def ended() -> bool:
        row = TaskResult.objects.filter(task_id=result.id).first()
        if row is not None:
            pid = json.loads(row.result or "null") if row.status == "STARTED" else None
            state = (row.status, pid.get("pid") if isinstance(pid, dict) else None)
            if not seen or seen[-1] != state:
                seen.append(state)
        return row is not None and row.status == "SUCCESS"

    wait_for(ended, 30, f"{result.id} to end", interval=0.02)
    found = quiet(result.id)
    recovered_in = {e.pid for e in effects(result.id) if e.execution == found.executions[-1]}
    stale_started = [state for state in seen if state[0] == "STARTED" and state[1] not in recovered_in]

    report(
        "a job handed to a frozen worker's pool",
        recovered_after=recovered_at - stopped,
        thawed_after_recovery=thawed - recovered_at,
        starts=starts(result.id),
        stale_started_rows=len(stale_started),
        states=" > ".join(state for state, _ in seen),
    )
    assert (starts(result.id), stored(result.id), len(found.executions)) == (1, 1, 1)
    assert not stale_started, seen
    assert TaskResult.objects.get(task_id=result.id).status == "SUCCESS"


def test_a_worker_booting_under_the_name_of_a_stalled_live_twin_leaves_the_twins_task_alone(
    workers: Any,
) -> None:
    from tests.workers import OWN_SWEEPS_ON

    # A lease long enough that the twin, stalled, still holds it after two heartbeats and half a second
    # (all the other boot's sweep once watched it for), and is thawed before it would give its boot up.
    env = {"CELERY_ORPHANS_LEASE_SECONDS": "10"}
    workers.own_sweeps = OWN_SWEEPS_ON
    twin = workers.start("twin@test", env=env)
    result = tick_on("celery", 14)
    started_on(result.id, "twin@test")
    processes = process_tree(twin.pid)
    freeze(processes)
    stopped = time.time()
    workers.start("twin@test", env=env)
    wait_for(
        lambda: len(overlap(result.id).executions) >= 2 or time.time() > stopped + 6.5,
        10,
        "the second boot's sweep",
        interval=0.05,
    )
    thaw(processes)
    thawed = time.time()
    found = quiet(result.id)

    report(
        "two workers with one node name",
        thawed_after=thawed - stopped,
        executions=len(found.executions),
        stale_effects=found.count,
        overlap_seconds=found.window,
    )
    assert_no_overlap(result.id)
