"""Redis, the database and the broker failing in the middle of a sweep, and workers outliving a Redis restart.

The ledger lives in a Redis server of the test's own (the run's own is never stopped), with an
append-only file, so it can be SIGKILLed and started again without losing what it held. The database
(PostgreSQL or MySQL/MariaDB) is shared too: its fault is the sweep's own session ended by the server.
A broker fault is an injected ``kombu.exceptions.OperationalError`` from the producer.

After every fault: the sweep stops with an error a caller can act on, no orphan is lost (each one is
recovered or found again by the next sweep), none runs twice, and once the fault clears the next sweep
completes.
"""

from __future__ import annotations

import gc
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
from django.core.management import CommandError, call_command
from django.db import DEFAULT_DB_ALIAS, DatabaseError, connection, connections
from django_celery_results.models import TaskResult
from kombu.exceptions import KombuError
from kombu.exceptions import OperationalError as KombuOperationalError
from kombu.messaging import Producer

from celery_orphans import sweep
from celery_orphans.decision import Action, Reason
from celery_orphans.exceptions import LedgerUnavailable
from celery_orphans.ledger import Ledger
from celery_orphans.models import OrphanEvent, Trigger
from celery_orphans.recovery import broker
from celery_orphans.recovery.executor import Executor
from celery_orphans.store import Keys, client
from celery_orphans.sweep import liveness, runner
from tests import factories
from tests.helpers import QUEUE, ledger_env, manage, published_ids, sweep_now, wait_for
from tests.services import RedisServer

ORPHANS = 5
FAULTED = 3  # the fault strikes at the third orphan's recovery


def terminate_own_database_session() -> None:
    """Have the database end this process's session, as a failover or an idle-session killer would."""
    mysql = connection.vendor == "mysql"
    with connection.cursor() as cursor:
        cursor.execute("SELECT CONNECTION_ID()" if mysql else "SELECT pg_backend_pid()")
        (session,) = cursor.fetchone()
    other = connections.create_connection(DEFAULT_DB_ALIAS)
    try:
        with other.cursor() as cursor:
            if mysql:
                cursor.execute("KILL CONNECTION %s", [session])
            else:
                cursor.execute("SELECT pg_terminate_backend(%s)", [session])
    finally:
        other.close()


@dataclass
class Fault:
    """One kind of failure, switched on at a chosen point of a sweep and cleared afterwards."""

    kind: str  # redis, database, broker
    server: RedisServer
    broker_down: bool = False
    struck: list[str] = field(default_factory=list)

    def inject(self, where: str) -> None:
        self.struck.append(where)
        if self.kind == "redis":
            self.server.stop()
        elif self.kind == "database":
            terminate_own_database_session()
        else:
            self.broker_down = True

    def clear(self) -> None:
        if self.kind == "redis":
            self.server.start()
        elif self.kind == "database":
            connection.close()  # the next query opens a new session
        self.broker_down = False


def arm(fault: Fault, point: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``fault`` strike at ``point`` of the next sweep, by wrapping the call that marks that point."""

    def refuse_when_down(original: Callable[..., Any]) -> Callable[..., Any]:
        def publish(self: Producer, *args: Any, **kwargs: Any) -> Any:
            if fault.broker_down:
                raise KombuOperationalError("injected: the broker refused the connection")
            return original(self, *args, **kwargs)

        return publish

    monkeypatch.setattr(Producer, "publish", refuse_when_down(Producer.publish))

    if point == "before_decisions":
        observe = liveness.observe

        def observe_after_fault(*args: Any, **kwargs: Any) -> Any:
            if not fault.struck:
                fault.inject(point)
            return observe(*args, **kwargs)

        monkeypatch.setattr(liveness, "observe", observe_after_fault)
    elif point == "between_recoveries":
        carry_out = Executor.carry_out
        calls = []

        def carry_out_after_fault(self: Executor, *args: Any, **kwargs: Any) -> Any:
            calls.append(1)
            if len(calls) == FAULTED:
                fault.inject(point)
            return carry_out(self, *args, **kwargs)

        monkeypatch.setattr(Executor, "carry_out", carry_out_after_fault)
    else:  # after_resend: the message is out, the bookkeeping is not done
        publish = broker.publish
        sent = []

        def publish_then_fault(*args: Any, **kwargs: Any) -> None:
            publish(*args, **kwargs)
            sent.append(1)
            if len(sent) == FAULTED:
                fault.inject(point)

        monkeypatch.setattr(broker, "publish", publish_then_fault)


# What the sweep raises at each fault: something a caller (the command, Beat, the admin) can act on.
CLEAR_ERRORS: dict[str, tuple[type[BaseException], ...]] = {
    "redis": (LedgerUnavailable, sweep.SweepFailed),
    "database": (DatabaseError,),
    "broker": (sweep.SweepFailed, KombuError),
}
KINDS = ("redis", "database", "broker")
POINTS = ("before_decisions", "between_recoveries", "after_resend")


@pytest.mark.worker
@pytest.mark.parametrize(
    ("kind", "point"), [pytest.param(k, p, id=f"{k}-{p}") for k in KINDS for p in POINTS]
)
def test_a_fault_inside_a_sweep_loses_no_orphan_and_runs_none_twice(
    kind: str,
    point: str,
    workers: Any,
    ledger_redis: RedisServer,
    redis_client: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from demoapp.tasks import runs

    ids = [factories.orphan() for _ in range(ORPHANS)]
    fault = Fault(kind, ledger_redis)
    arm(fault, point, monkeypatch)

    with pytest.raises(Exception) as raised:  # noqa: PT011 - which one is the point of the check below
        sweep_now()

    assert fault.struck == [point]
    error = raised.value
    assert isinstance(error, CLEAR_ERRORS[kind]), f"the sweep ended with {type(error).__name__}: {error}"
    if isinstance(error, sweep.SweepFailed):
        # It stopped at the task it could not act on, and kept what it had finished.
        stopped = [o for o in error.report.outcomes if o.error]
        assert len(stopped) == 1
        done = [o.decision.task_id for o in error.report.outcomes if o.done]
        finished = ids[: ids.index(stopped[0].decision.task_id)]
        assert done == finished
        kept = set(TaskResult.objects.filter(status="RETRY").values_list("task_id", flat=True))
        assert kept == set(done), "SweepFailed reports recoveries done that the database did not keep"
    fault.clear()

    final = sweep_now()  # the fault cleared: the next sweep completes
    assert not any(o.error for o in final.outcomes)
    assert sweep_now().count(Action.RECOVER, done_only=True) == 0  # and there is nothing left to do

    # Nothing lost: every orphan was sent again, and none was given up on.
    sent = published_ids(redis_client)
    assert set(sent) == set(ids)
    assert set(TaskResult.objects.filter(task_id__in=ids).values_list("status", flat=True)) == {"RETRY"}
    assert not OrphanEvent.objects.filter(action="marked_terminal").exists()
    assert sent == dict.fromkeys(ids, 1), "an orphan was published more than once"
    recovered = Counter(OrphanEvent.objects.filter(action="recovered").values_list("task_id", flat=True))
    assert recovered == dict.fromkeys(ids, 1), "a recovery was recorded more than once"

    # Nothing runs twice: a worker consumes every copy that was sent, and runs each orphan once.
    workers.start("faults@test", env=ledger_env(ledger_redis))
    wait_for(
        lambda: TaskResult.objects.filter(task_id__in=ids, status="SUCCESS").count() == ORPHANS,
        30,
        "every orphan to run",
    )
    wait_for(lambda: redis_client.llen(QUEUE) == 0, 10, "every copy to be consumed")
    executions = {task_id: [e.split(":")[0] for e in runs(task_id)] for task_id in ids}
    assert executions == {task_id: ["start", "finish"] for task_id in ids}
    # A finished task's entry goes with the worker's next ledger write, or a moment later.
    wait_for(lambda: Ledger(client(), Keys.current()).count() == 0, 5, "every ledger entry to be removed")


@pytest.mark.worker
def test_a_recovery_whose_entry_could_not_be_released_still_runs_at_the_cap(
    workers: Any, ledger_redis: RedisServer, redis_client: Any, settings: Any, tmp_path: Path, monkeypatch
) -> None:
    from demoapp.tasks import runs

    settings.CELERY_ORPHANS_MAX_ATTEMPTS = 1
    task_id = factories.orphan()

    def fail_release(self: Ledger, *args: Any) -> bool:
        raise redis.ConnectionError("injected: Redis went away as the sweep committed")

    with monkeypatch.context() as patch:
        patch.setattr(Ledger, "release", fail_release)
        first = sweep_now()
    second = sweep_now()

    assert [o.decision.action for o in first.outcomes if o.done] == [Action.RECOVER]
    assert published_ids(redis_client) == {task_id: 1}
    worker = workers.start("cap@test", env=ledger_env(ledger_redis))
    wait_for(
        lambda: (
            "dropped a stale copy" in worker.log() or TaskResult.objects.filter(status="SUCCESS").exists()
        ),
        20,
        "the recovered copy to be run or dropped",
    )
    outcome = {o.decision.task_id: o for o in second.outcomes}[task_id]
    assert (outcome.decision.action, outcome.decision.reason) == (Action.RECOVER, Reason.ALREADY_SENT)
    wait_for(lambda: any(e.startswith("finish") for e in runs(task_id)), 20, "the copy sent to finish")
    assert "dropped a stale copy" not in worker.log()
    assert published_ids(redis_client) == {}  # consumed, and never sent a second time
    assert OrphanEvent.objects.filter(task_id=task_id, action="recovered").count() == 1
    assert not OrphanEvent.objects.filter(action="marked_terminal").exists()


# --- what a caller sees --------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_command_exits_non_zero_with_a_message_when_the_ledger_redis_is_down(
    ledger_redis: RedisServer, redis_client: Any, celery_app: Any
) -> None:
    factories.orphan()
    ledger_redis.stop()

    # The test project takes its ledger URL from REDIS_URL; the broker stays up.
    env = {"REDIS_URL": ledger_redis.url(), "CELERY_BROKER_URL": str(celery_app.conf.broker_url)}
    done = manage("reconcile_orphan_tasks", env=env)

    assert done.returncode == 1
    assert "cannot reach Redis" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.django_db(transaction=True)
def test_command_turns_a_broker_failure_into_a_command_error(
    ledger_redis: RedisServer, redis_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    factories.orphan()
    fault = Fault("broker", ledger_redis)
    arm(fault, "before_decisions", monkeypatch)

    with pytest.raises(CommandError, match="broker"):
        call_command("reconcile_orphan_tasks")


# --- workers and a Redis restart -----------------------------------------------------------------


@pytest.mark.worker
def test_workers_outlive_a_restart_of_the_ledger_redis_and_are_never_taken_for_dead(
    workers: Any, ledger_redis: RedisServer, redis_client: Any, tmp_path: Path, settings: Any
) -> None:
    from demoapp.tasks import runs, summarize

    settings.CELERY_ORPHANS_INSPECT_TIMEOUT_SECONDS = 1.0  # live workers here: let them answer
    # A lease that outlives the outage: a worker that cannot renew for longer gives its tasks up
    # (tests/test_never_twice.py).
    env = {
        **ledger_env(ledger_redis),
        "CELERY_ORPHANS_LEASE_SECONDS": "10",
        "CELERY_ORPHANS_HEARTBEAT_SECONDS": "1",
    }
    pair = [workers.start("steady-a@test", env=env, concurrency=2), workers.start("steady-b@test", env=env)]
    before = [summarize.delay([i], seconds=14) for i in range(2)]
    wait_for(lambda: all(runs(r.id) for r in before), 20, "both tasks to begin")

    ledger_redis.stop()
    for w in pair:
        wait_for(lambda w=w: "cannot renew the lease" in w.log(), 10, f"{w.name} to lose its Redis")
    # It cannot be recorded: it goes back to the broker unrun, held until the ledger answers (within
    # LEDGER_HOLD_SECONDS), not run unprotected.
    during = summarize.delay([7], seconds=6)
    with pytest.raises(LedgerUnavailable):
        sweep.run(sweep.Options(trigger=Trigger.BEAT))
    time.sleep(2.5)  # longer than the suite's usual lease (2 s), well within this one
    assert not runs(during.id)
    ledger_redis.start()
    for w in pair:
        wait_for(lambda w=w: "renewed again" in w.log(), 10, f"{w.name}'s lease to come back")

    # Past the grace, while every task still runs: each is judged alive, none recovered.
    deadline = time.monotonic() + 6
    judged = []
    while time.monotonic() < deadline:
        report = sweep.run(sweep.Options(trigger=Trigger.BEAT))
        judged += [(o.decision.task_id, o.decision.action, o.decision.reason.value) for o in report.outcomes]
        time.sleep(0.5)
    assert {action for _, action, _ in judged} == {Action.LEAVE}
    assert {task_id for task_id, _, reason in judged if reason == "alive"} >= {r.id for r in before}

    assert [r.get(timeout=30) for r in before] == [0, 1]
    assert during.get(timeout=30) == 7
    for r in [*before, during]:
        assert [e.split(":")[0] for e in runs(r.id)] == ["start", "finish"]
    assert not OrphanEvent.objects.exists()
    assert all(w.is_running() for w in pair)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("enabled", [True, False])
def test_a_sweep_gives_the_garbage_collector_back_as_it_found_it_even_when_it_fails(
    enabled: bool, monkeypatch: pytest.MonkeyPatch, redis_client: redis.Redis
) -> None:
    collecting: list[bool] = []

    def redis_gone(*args: Any, **kwargs: Any) -> Any:
        collecting.append(gc.isenabled())
        raise redis.ConnectionError("injected: Redis went away as the sweep gathered")

    monkeypatch.setattr(runner, "find", redis_gone)
    (gc.enable if enabled else gc.disable)()
    try:
        with pytest.raises(LedgerUnavailable):
            sweep.run(sweep.Options(trigger=Trigger.COMMAND, dry_run=True))
        assert collecting == [False]  # held off while gathering
        assert gc.isenabled() is enabled
    finally:
        gc.enable()


@pytest.mark.worker
def test_a_ledger_redis_that_loses_its_data_marks_the_running_task_terminal_and_never_runs_it_twice(
    workers: Any, tmp_path: Path, redis_client: Any, settings: Any
) -> None:
    from demoapp.tasks import runs, summarize

    volatile = RedisServer(tmp_path / "volatile").start()  # keeps nothing on disk
    try:
        settings.CELERY_ORPHANS_REDIS_URL = volatile.url()
        settings.CELERY_ORPHANS_INSPECT_TIMEOUT_SECONDS = 1.0
        doomed = workers.start("forgetful@test", env=ledger_env(volatile))
        result = summarize.delay([4], seconds=8)
        wait_for(lambda: runs(result.id), 20, "the task to begin")
        wait_for(lambda: Ledger(client(), Keys.current()).count() == 1, 10, "its ledger entry")

        volatile.stop()
        volatile.start()  # the same address, every key gone
        doomed.kill()
        report = wait_for(lambda: [o for o in sweep_now().outcomes if o.done], 20, "the orphan to be handled")

        (outcome,) = report
        assert (outcome.decision.action, outcome.decision.reason) == (
            Action.MARK_TERMINAL,
            Reason.NO_LEDGER_ENTRY,
        )
        assert TaskResult.objects.get(task_id=result.id).status == "FAILURE"
        # That nothing sends it again is the point, and nothing would announce it: 3 s, longer than the
        # suite's lease (2 s) and than a sweep here, in which a re-send would be queued or started.
        time.sleep(3)
        assert [e.split(":")[0] for e in runs(result.id)] == ["start"]
        assert redis_client.llen(QUEUE) == 0
    finally:
        workers.close()  # before their ledger goes
        volatile.stop()
