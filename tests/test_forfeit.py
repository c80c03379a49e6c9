"""A worker's forfeit (worker/forfeit.py), in this process: which executions hold, what a forfeit one
may no longer do, and which pool processes a forfeit stops. The end-to-end cases, with real workers
frozen and cut off, are in test_never_twice.py and test_pools.py."""

from __future__ import annotations

import contextlib
import signal
import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery
from celery.exceptions import Retry
from celery.worker import state

from celery_orphans.exceptions import ExecutionForfeit
from celery_orphans.worker import clock, forfeit

pytestmark = pytest.mark.usefixtures("shared_validity")


def request(generation: object) -> Any:
    return SimpleNamespace(**{forfeit.GENERATION: generation}, id="t-1", name="demoapp.summarize")


def test_an_execution_holds_until_its_generations_renewal_runs_out():
    forfeit.hold_until(3, clock.now() + 60)

    assert forfeit.holds(3)
    assert not forfeit.holds(2)  # an older generation: its boot was given up
    forfeit.hold_until(3, clock.now() - 1)
    assert not forfeit.holds(3)  # no renewal came in time


def test_after_a_withdrawal_every_older_generation_is_forfeit():
    forfeit.hold_until(3, clock.now() + 60)

    forfeit.withdraw(4)

    assert forfeit.is_forfeit(request(3))
    assert not forfeit.holds(4)  # the new generation holds once its first renewal is published
    forfeit.hold_until(4, clock.now() + 60)
    assert forfeit.holds(4)


def test_an_execution_admitted_without_a_generation_is_never_forfeit():
    forfeit.withdraw(9)

    assert not forfeit.is_forfeit(request(None))
    assert not forfeit.is_forfeit(request("1"))  # not a generation the main process set


def make_task(body: Any) -> Any:
    app = Celery("forfeit-test", set_as_current=False)
    name = f"forfeit.body.{uuid.uuid4().hex}"  # one callable per name, as Celery asks

    @app.task(bind=True, name=name)
    def task(self: Any, *args: Any) -> Any:
        return body(*args)

    return app.tasks[name]


@contextlib.contextmanager
def guarded(body: Any) -> Iterator[Any]:
    """A guarded task running ``body`` in an execution of generation 1, which holds."""
    task = make_task(body)
    forfeit.guard_task(task)
    task.push_request(**{forfeit.GENERATION: 1}, id="t-1")
    try:
        forfeit.hold_until(1, clock.now() + 60)
        yield task
    finally:
        task.pop_request()


@pytest.mark.parametrize("holds", [True, False])
def test_an_execution_forfeit_before_it_starts_neither_runs_nor_writes_started(holds: bool) -> None:
    # Celery's tracer, as a pool that cannot kill its process runs it (the solo, threads, gevent and
    # eventlet pools): task_prerun comes before the STARTED write and the body.
    from celery.app.trace import build_tracer

    ran: list[str] = []
    task = make_task(lambda: ran.append("body"))
    task.track_started = True
    stored: list[str] = []
    task.backend.store_result = lambda task_id, meta, state, **kw: stored.append(state)
    task.backend.mark_as_done = lambda *args, **kwargs: stored.append("SUCCESS")
    trace = build_tracer(task.name, task, eager=False, propagate=True, app=task.app)
    forfeit.hold_until(1, clock.now() + 60)
    if not holds:
        forfeit.withdraw(2)

    with contextlib.nullcontext() if holds else pytest.raises(forfeit.NotStarted):
        trace("t-1", (), {}, {forfeit.GENERATION: 1, "id": "t-1"})

    assert (ran, stored) == ((["body"], ["STARTED", "SUCCESS"]) if holds else ([], []))


def test_a_guarded_body_of_a_forfeit_execution_may_not_store_its_result():
    with guarded(lambda: "result") as task:
        forfeit.guard_task(task)  # guarding twice wraps once
        assert task.run() == "result"
        forfeit.withdraw(2)
        with pytest.raises(ExecutionForfeit, match="may not store its result"):
            task.run()
        with pytest.raises(ExecutionForfeit, match="may not retry"):
            task.retry()


def test_a_forfeit_execution_may_not_end_with_an_error_either():
    def fails() -> None:
        raise KeyError("boom")

    with guarded(fails) as task:
        with pytest.raises(KeyError):
            task.run()  # it holds: the error is the task's own
        forfeit.withdraw(2)
        with pytest.raises(ExecutionForfeit, match="may not end with KeyError"):
            task.run()


def test_a_retry_its_check_let_through_ends_as_a_retry_though_the_validity_passes_meanwhile():
    # retry() sent the retry once its own check passed; the execution must end as Celery's Retry, not as
    # a forfeit whose entry the sweep would recover beside the retry already sent.
    def retries() -> None:
        forfeit.withdraw(2)  # the validity passes between the retry's check and the body's end
        raise Retry("again")

    with guarded(retries) as task, pytest.raises(Retry):
        task.run()


class Pool:
    """Stands in for a pool: records which executions it was asked to kill."""

    def __init__(self, refuse: type[BaseException] | None = None, *, green: bool = True) -> None:
        self.killed: list[tuple[int, int]] = []
        self.refuse = refuse
        self.is_green = green

    def terminate_job(self, pid: int, sig: int) -> None:
        if self.refuse is not None:
            raise self.refuse()
        self.killed.append((pid, sig))


@pytest.fixture
def active(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    running: list[Any] = []
    monkeypatch.setattr(state, "active_requests", running)
    return running


@pytest.mark.parametrize(
    ("green", "killed"),
    [
        pytest.param(True, [(101, signal.SIGKILL)], id="green-threads-killed"),
        # A pid read from active_requests may by now run the next task: the process kills itself (watchdog).
        pytest.param(False, [], id="prefork-pool-processes-left-to-kill-themselves"),
    ],
)
def test_a_forfeit_stops_the_executions_of_its_generation_and_older_only(active, green, killed):
    old = SimpleNamespace(_orphans_generation=1, worker_pid=101, name="a", id="1")
    current = SimpleNamespace(_orphans_generation=2, worker_pid=102, name="b", id="2")
    unrecorded = SimpleNamespace(worker_pid=103, name="c", id="3")  # not a recoverable task
    active.extend([old, current, unrecorded])
    pool = Pool(green=green)

    assert forfeit.stop_executions(pool, 1) == 1

    assert pool.killed == killed
    assert old._orphans_forfeit is True and not hasattr(current, "_orphans_forfeit")


@pytest.mark.parametrize("refusal", [NotImplementedError, ProcessLookupError])
def test_a_pool_that_cannot_kill_still_counts_the_execution_forfeit(active, refusal):
    running = SimpleNamespace(_orphans_generation=1, worker_pid=101, name="a", id="1")
    active.append(running)

    assert forfeit.stop_executions(Pool(refuse=refusal), 1) == 1
    assert running._orphans_forfeit is True


# A pool process paused as its execution began (watchdog.begin) before its main process handled the
# pool's word that it took the job: the request is not in active_requests yet. Its generation given up
# meanwhile, the main process's pass found no request of a paused generation left and stopped looking
# (the slot [6] cleared): the request that showed up next was never looked at, and its process stayed
# stopped for ever, holding what it held (a transaction, a lock), its slot in the pool lost.
def test_a_paused_process_whose_request_shows_up_late_is_still_killed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import subprocess
    import time

    from celery_orphans import processes

    child = subprocess.Popen(["sleep", "60"])
    try:
        os_kill = __import__("os").kill
        os_kill(child.pid, signal.SIGSTOP)
        for _ in range(100):
            if processes.stopped(child.pid):
                break
            time.sleep(0.01)
        running: list[Any] = []
        monkeypatch.setattr(state, "active_requests", running)
        forfeit.hold_until(3, clock.now() + 60)
        forfeit.presence_lost(clock.now() - 0.01)
        forfeit.main_alive()
        assert forfeit.pauses(3)
        forfeit.pausing(3)
        forfeit.withdraw(4)  # given up before the main process heard of the job
        forfeit.settle_paused()

        running.append(SimpleNamespace(_orphans_generation=3, worker_pid=child.pid, id="t-1", name="x"))
        forfeit.settle_paused()
        assert child.wait(timeout=2) == -signal.SIGKILL
    finally:
        child.kill()
        child.wait()
