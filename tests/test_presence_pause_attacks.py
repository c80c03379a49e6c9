"""The pause of a presence loss (``PRESENCE_LOSS_PAUSES``) attacked with real workers: what a paused pool
process does when its whole worker is stopped and continued, when its main process dies or freezes, and
when the ledger goes away for longer than the lease's margin. Renewals 2 s apart and a 10 s lease, the
defaults; the overlap checker judges what the task's executions did."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from celery_orphans import processes
from celery_orphans.models import OrphanEvent
from celery_orphans.worker.presence import CLIENT_NAME
from tests.faults import effects, longest_pause, pool_processes, quiet, report, tick_beside_a_watcher
from tests.helpers import finishes, ledger_env, starts, sweep_now, wait_for
from tests.services import TcpProxy

pytestmark = pytest.mark.worker

PAUSED = "pauses its execution: the presence connection of its worker was lost"


@contextlib.contextmanager
def paused_by_a_cut_link(workers: Any, redis_client: Any, name: str, seconds: float) -> Iterator[Any]:
    """A tick on a live worker whose ledger link is reset, then blackholed: the worker hears its presence
    end, cannot connect again nor renew, and its pool process pauses. Yields (worker, result, pool pid,
    the moment the link was cut, the link)."""
    link = TcpProxy(int(redis_client.connection_pool.connection_kwargs["port"]))
    try:
        env = {"CELERY_ORPHANS_REDIS_URL": link.url()}
        live, result = tick_beside_a_watcher(workers, name, seconds, env=env)
        (pid,) = pool_processes(live)
        link.cut()
        cut = time.time()
        time.sleep(0.2)
        link.blackhole()
        wait_for(lambda: PAUSED in live.log() and processes.stopped(pid), 10, "the pause")
        yield live, result, pid, cut, link
    finally:
        link.close()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie of a dead parent is reaped by init; one of a live parent counts as gone.
    return (processes._stat(pid) or ("Z",))[0] != "Z"


# 1. The whole worker stopped (its process group) while its pool process is paused, and continued once
# another worker judged the boot and the recovered execution started: the pool process is continued by
# the group's SIGCONT, not by its main process.
@pytest.mark.parametrize("frozen", [4.0, 9.0])
def test_a_paused_worker_stopped_and_continued_whole_does_not_act_after_its_recovery(
    workers: Any, redis_client: Any, frozen: float
) -> None:
    with paused_by_a_cut_link(workers, redis_client, f"group-{frozen}", 30) as (live, result, pid, cut, _):
        os.killpg(live.pid, signal.SIGSTOP)
        stopped = time.time()
        wait_for(lambda: starts(result.id) >= 2, 30, "the recovered execution")
        recovered = time.time()
        time.sleep(max(0.0, stopped + frozen - time.time()))
        os.killpg(live.pid, signal.SIGCONT)
        continued = time.time()
        wait_for(lambda: not alive(pid), 15, "the paused pool process killed")
        died = time.time()
        found = quiet(result.id, seconds=3, timeout=60)
    report(
        "worker stopped whole while paused, continued after its recovery",
        frozen=frozen,
        paused_after=stopped - cut,
        recovered_after=recovered - cut,
        killed_after_continue=died - continued,
        executions=len(found.executions),
        stale_effects=found.count,
        overlap_seconds=found.window,
    )
    assert len(found.executions) == 2 and not found.stale, str(found)


# 2. The main process killed while its pool process is paused: the kernel kills the pool process with it
# (PR_SET_PDEATHSIG is SIGKILL, which a stopped process does not hold off), and the task runs again once.
def test_a_paused_pool_process_dies_with_its_main_process(workers: Any, redis_client: Any) -> None:
    with paused_by_a_cut_link(workers, redis_client, "main-killed", 12) as (live, result, pid, _, _):
        killed = time.time()
        os.kill(live.pid, signal.SIGKILL)
        wait_for(lambda: not alive(pid), 15, "the paused pool process gone with its main process")
        died = time.time()
        wait_for(lambda: starts(result.id) >= 2, 40, "the recovered execution")
        recovered = time.time()
        assert result.get(timeout=60) is not None
        found = quiet(result.id, seconds=2, timeout=60)
    report(
        "main process killed while paused",
        pool_process_gone_after=died - killed,
        recovered_after=recovered - killed,
        executions=len(found.executions),
        finishes=finishes(result.id),
        stale_effects=found.count,
    )
    assert (starts(result.id), finishes(result.id)) == (2, 1)
    assert not found.stale, str(found)
    # One pause, said once (its line and Celery's copy of its stderr): its process stopped at the first
    # SIGSTOP. Sent to the process, not the thread, the watchdog looped and logged 3 to 85 times in 4 ms.
    assert live.log().count(PAUSED) <= 2, live.log().count(PAUSED)


# 3. The main process frozen alone while its pool process is paused, thawed once its lease lapsed and the
# task was recovered: the paused process is killed, not continued.
def test_a_paused_pool_process_of_a_main_process_thawed_after_its_lease_is_killed(
    workers: Any, redis_client: Any
) -> None:
    with paused_by_a_cut_link(workers, redis_client, "main-frozen", 40) as (live, result, pid, cut, _):
        os.kill(live.pid, signal.SIGSTOP)
        try:
            wait_for(lambda: starts(result.id) >= 2, 30, "the recovered execution")
            recovered = time.time()
            time.sleep(max(0.0, cut + 12 - time.time()))  # past the lease's end by its own clock
        finally:
            os.kill(live.pid, signal.SIGCONT)
        thawed = time.time()
        wait_for(lambda: not alive(pid), 15, "the paused pool process killed")
        died = time.time()
        found = quiet(result.id, seconds=3, timeout=60, stale=True)
    stale = [e for e in effects(result.id) if e.execution == found.executions[0] and e.at > thawed - 0.5]
    report(
        "main process frozen while paused, thawed after its lease",
        recovered_after=recovered - cut,
        killed_after_thaw=died - thawed,
        executions=len(found.executions),
        stale_effects=found.count,
        effects_after_thaw=len(stale),
    )
    assert "kills the paused pool process" in live.log() or not alive(pid)
    assert len(found.executions) == 2 and not found.stale, str(found)
    assert OrphanEvent.objects.filter(task_id=result.id).count() == 1


# 4. The ledger's Redis down longer than the lease's margin (9 s; the lease holds 8 s after a renewal by
# the worker's clock): the paused execution is given up with the lease, and runs again once elsewhere.
def test_a_ledger_restart_longer_than_the_lease_margin_runs_the_task_again_once(
    workers: Any, ledger_redis: Any
) -> None:
    live, result = tick_beside_a_watcher(workers, "long-restart-9", 14, shared=ledger_env(ledger_redis))
    (pid,) = pool_processes(live)
    ledger_redis.stop()
    down = time.time()
    time.sleep(9)
    ledger_redis.start()
    # Given up, its entry waits for a sweep: Beat's (every 5 s by default), here the test's. The worker
    # dropped its old boot's records, so no watch reports its lease lapsed.
    wait_for(lambda: sweep_now() is not None and finishes(result.id) >= 1, 60, "the task run again")
    found = quiet(result.id, seconds=3, timeout=60)
    from django_celery_results.models import TaskResult

    row = TaskResult.objects.get(task_id=result.id)
    report(
        "ledger down 9 s",
        paused=int(PAUSED in live.log()),
        given_up=int("gives up its boot" in live.log()),
        pool_process_alive=int(alive(pid)),
        executions=len(found.executions),
        starts=starts(result.id),
        finishes=finishes(result.id),
        stale_effects=found.count,
        status=row.status,
        since_down=time.time() - down,
    )
    assert finishes(result.id) == 1 and not found.stale, str(found)
    assert row.status == "SUCCESS"


class LoadingRedis:
    """A server that answers every command as a Redis loading its data set does (``-LOADING``): the
    ledger's Redis just restarted, or a replica in its first sync."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self.answered = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError), conn:
            while conn.recv(65536):
                self.answered += 1
                conn.sendall(b"-LOADING Redis is loading the dataset in memory\r\n")

    def close(self) -> None:
        self.listener.close()


# 7. A paused execution whose boot was judged (its task recovered and running elsewhere), then the ledger
# comes back as a server loading its data (restarted meanwhile). Only a renewal that finds the lease may
# continue a paused execution: a connection refused as loading says nothing of what was judged before.
def test_a_paused_execution_judged_meanwhile_is_not_continued_by_a_ledger_that_is_loading(
    workers: Any, redis_client: Any
) -> None:
    loading = LoadingRedis()
    try:
        with paused_by_a_cut_link(workers, redis_client, "loading", 40) as (live, result, _, cut, link):
            wait_for(lambda: starts(result.id) >= 2, 30, "the recovered execution")
            recovered = time.time()
            # The ledger comes back loading: every connection of the worker meets it from now on.
            link.cut()
            link.target = loading.port
            link.restore()
            time.sleep(4)
            found = quiet(result.id, seconds=2, timeout=60, stale=True)
            continued = "continues the paused pool process" in live.log()
    finally:
        loading.close()
    report(
        "paused, judged, then the ledger comes back loading",
        recovered_after=recovered - cut,
        loading_answers=loading.answered,
        continued=int(continued),
        executions=len(found.executions),
        stale_effects=found.count,
        overlap_seconds=found.window,
    )
    assert not continued
    assert len(found.executions) == 2 and not found.stale, str(found)


# 6. The healthy case: short tasks on two prefork workers, the ledger's Redis restarted for 3 s in the
# middle. Each task runs once and ends; nothing is given up.
def test_a_ledger_restart_under_load_gives_nothing_up_and_runs_each_task_once(
    workers: Any, ledger_redis: Any
) -> None:
    from demoapp.tasks import add
    from django_celery_results.models import TaskResult

    from tests.faults import DEFAULT_TIMINGS
    from tests.workers import OWN_SWEEPS_ON

    workers.own_sweeps = {**OWN_SWEEPS_ON, **DEFAULT_TIMINGS, **ledger_env(ledger_redis)}
    for n in (1, 2):
        workers.start(f"load-{n}@test", concurrency=2)
    time.sleep(4)  # each one's presence recorded by two renewals
    begun = time.time()
    results = [add.apply_async((i, 1), {"seconds": 0.3}) for i in range(200)]
    time.sleep(5)
    ledger_redis.stop()
    down = time.time()
    time.sleep(3)
    ledger_redis.start()
    up = time.time()

    def done() -> bool:
        sweep_now()  # Beat's, every 5 s by default
        return TaskResult.objects.filter(
            task_id__in=[r.id for r in results], status="SUCCESS"
        ).count() == len(results)

    try:
        wait_for(done, 120, "every task to succeed", interval=2)
    finally:
        ended = time.time()
        counts = [(starts(r.id), finishes(r.id)) for r in results]
        logs = "".join(w.log() for w in workers)
        report(
            "200 tasks on 2 workers, the ledger down 3 s",
            down_after=down - begun,
            up_for=ended - up,
            tasks=len(results),
            ran_twice=sum(1 for s, _ in counts if s > 1),
            finished_twice=sum(1 for _, f in counts if f > 1),
            never_finished=sum(1 for _, f in counts if f == 0),
            pauses=logs.count("pauses its execution") // 2,
            continued=logs.count("continues the paused pool process") // 2,
            killed=logs.count("kills the paused pool process") // 2,
            given_up=logs.count("gives up its boot") // 2,
            not_success=TaskResult.objects.filter(task_id__in=[r.id for r in results])
            .exclude(status="SUCCESS")
            .count(),
        )
    assert all(c == (1, 1) for c in counts), counts
    assert "gives up its boot" not in logs


# 5. A paused execution holds its transaction's lock; the recovered copy, which needs it too, waits until
# the paused process is killed (the lease's margin), not just until it was judged.
def test_a_recovered_copy_waits_for_the_lock_a_paused_execution_holds(
    workers: Any, redis_client: Any
) -> None:
    from celery import current_app
    from demoapp.tasks import locked_tick, runs

    from tests.faults import DEFAULT_TIMINGS
    from tests.helpers import started_on
    from tests.workers import OWN_SWEEPS_ON

    link = TcpProxy(int(redis_client.connection_pool.connection_kwargs["port"]))
    try:
        workers.own_sweeps = {**OWN_SWEEPS_ON, **DEFAULT_TIMINGS}
        live = workers.start("live-lock@test", queues=("lock",), env={"CELERY_ORPHANS_REDIS_URL": link.url()})
        workers.start("watcher-lock@test")
        result = locked_tick.apply_async((4242, 40), queue="lock")
        started_on(result.id, live.name)
        current_app.control.add_consumer("lock", destination=["watcher-lock@test"], reply=True, timeout=5)
        time.sleep(4)
        (pid,) = pool_processes(live)
        link.cut()
        cut = time.time()
        time.sleep(0.2)
        link.blackhole()
        wait_for(lambda: processes.stopped(pid), 10, "the pause")
        paused = time.time()
        wait_for(lambda: starts(result.id) >= 2, 30, "the recovered execution")
        wait_for(lambda: not alive(pid), 30, "the paused process killed")
        killed = time.time()
        wait_for(
            lambda: sum(e.startswith("locked") for e in runs(result.id)) >= 2, 30, "the lock taken again"
        )
        found = quiet(result.id, seconds=2, timeout=60, stale=True)
    finally:
        link.close()
    events = runs(result.id)
    second_start = float([e for e in events if e.startswith("start")][1].rsplit(":", 1)[1])
    second_locked = float([e for e in events if e.startswith("locked")][1].rsplit(":", 1)[1])
    report(
        "a paused execution holding a PostgreSQL lock",
        paused_after=paused - cut,
        recovered_started_after=second_start - cut,
        paused_killed_after=killed - cut,
        recovered_waited_for_lock=second_locked - second_start,
        recovered_locked_after_kill=second_locked - killed,
        stale_effects=found.count,
    )
    assert not found.stale, str(found)


# 4b. Only the presence connection meets a fault (``only``: the renewals pass): reset (and each new one
# closed), blackholed, or one way. Held 12 s, longer than the lease.
@pytest.mark.parametrize("fault", ["cut", "blackhole", "up", "down"])
def test_a_fault_on_the_presence_connection_alone_runs_the_task_once(
    workers: Any, redis_client: Any, fault: str
) -> None:
    from tests.services import DOWN, UP

    link = TcpProxy(int(redis_client.connection_pool.connection_kwargs["port"]), only=CLIENT_NAME.encode())
    try:
        env = {"CELERY_ORPHANS_REDIS_URL": link.url()}
        live, result = tick_beside_a_watcher(workers, f"only-{fault}", 24, env=env)
        {
            "cut": link.cut,
            "blackhole": link.blackhole,
            "up": lambda: link.one_way(UP),
            "down": lambda: link.one_way(DOWN),
        }[fault]()
        time.sleep(12)
        link.restore()
        assert result.get(timeout=60) is not None
        found = quiet(result.id, seconds=2, timeout=60)
    finally:
        link.close()
    log = live.log()
    report(
        "a fault on the presence connection alone",
        kind=fault,
        faulted=link.faulted,
        paused=int(PAUSED in log),
        continued=log.count("continues the paused pool process") // 2,
        given_up=int("gives up its boot" in log),
        longest_pause=longest_pause(result.id),
        executions=len(found.executions),
        finishes=finishes(result.id),
        stale_effects=found.count,
        events=OrphanEvent.objects.filter(task_id=result.id).count(),
    )
    assert len(found.executions) == 1 and finishes(result.id) == 1


# 7b. A Celery hard time limit firing on a task paused by a restart of the ledger. The task overruns its
# limit anyway: unpaused, it ends FAILURE (TimeLimitExceeded) and its entry goes.
def test_a_hard_time_limit_on_a_paused_task_ends_it_as_without_the_pause(
    workers: Any, ledger_redis: Any
) -> None:
    from demoapp.tasks import tick
    from django_celery_results.models import TaskResult

    from tests.faults import DEFAULT_TIMINGS
    from tests.helpers import started_on
    from tests.workers import OWN_SWEEPS_ON

    workers.own_sweeps = {**OWN_SWEEPS_ON, **DEFAULT_TIMINGS, **ledger_env(ledger_redis)}
    live = workers.start("live-limit@test", queues=("limit",))
    time.sleep(4)
    result = tick.apply_async((12,), {"every": 0.25}, queue="limit", time_limit=4)
    started_on(result.id, live.name)
    time.sleep(1)
    ledger_redis.stop()
    time.sleep(5)  # paused 1.5 s in, the limit fires 4 s in
    ledger_redis.start()
    deadline = time.time() + 30
    while time.time() < deadline:
        sweep_now()
        row = TaskResult.objects.get(task_id=result.id)
        if row.status not in ("STARTED", "PENDING"):
            break
        time.sleep(1)
    time.sleep(3)
    row = TaskResult.objects.get(task_id=result.id)
    log = live.log()
    report(
        "a hard time limit firing on a paused task",
        status=row.status,
        paused=int(PAUSED in log),
        limit_fired=int("TimeLimitExceeded" in log or "Hard time limit" in log),
        starts=starts(result.id),
        finishes=finishes(result.id),
        result=str(row.result)[:60],
        events=OrphanEvent.objects.filter(task_id=result.id).count(),
    )
    assert row.status == "FAILURE" and starts(result.id) == 1, (row.status, row.result)


# 7c. A paused pool process continued from outside (an operator's kill -CONT, a supervisor that continues
# what it stops) while its boot was judged and its main process, cut off, still holds its lease by the
# clock: the watchdog stops it again at once; its body must not act in between.
def test_a_paused_execution_continued_from_outside_does_not_act(workers: Any, redis_client: Any) -> None:
    with paused_by_a_cut_link(workers, redis_client, "outside", 40) as (_, result, pid, cut, _):
        wait_for(lambda: starts(result.id) >= 2, 30, "the recovered execution")
        recovered = time.time()
        sent = 0
        while alive(pid) and time.time() < recovered + 3:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
                sent += 1
            time.sleep(0.02)
        found = quiet(result.id, seconds=2, timeout=60, stale=True)
    report(
        "a paused execution continued from outside after its recovery",
        recovered_after=recovered - cut,
        sigconts=sent,
        executions=len(found.executions),
        stale_effects=found.count,
        overlap_seconds=found.window,
    )
    assert not found.stale, str(found)
