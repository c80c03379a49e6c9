"""The core recoveries with RabbitMQ as the broker (the ledger and leases stay in Redis).

RabbitMQ differs from the Redis transport where it matters most: when a worker's connection drops, the
broker puts its unacknowledged messages back in the queue at once. So after a SIGKILL two copies of an
orphan can meet a worker: RabbitMQ's redelivery of the original, and the copy a sweep sent. Whichever
order they come in, the task must run to completion exactly once.

The workers get the broker through ``CELERY_BROKER_URL``; this process switches to it through the
``amqp_broker`` fixture (tests/conftest.py).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from django_celery_results.models import TaskResult

from celery_orphans import sweep
from celery_orphans.decision import Action, Evidence
from celery_orphans.entry import Entry
from celery_orphans.ledger import Ledger
from celery_orphans.models import OrphanEvent
from celery_orphans.store import Keys, client
from tests.helpers import dropped_a_stale_copy, sweep_now, wait_for

pytestmark = pytest.mark.worker


def on(amqp_url: str) -> dict[str, str]:
    """A worker's environment for the broker at ``amqp_url``."""
    return {"CELERY_BROKER_URL": amqp_url}


def begun(task_id: str, timeout: float = 20) -> None:
    """The task's body has begun (its row may say STARTED a moment before the body runs)."""
    from demoapp.tasks import runs

    wait_for(lambda: any(e.startswith("start") for e in runs(task_id)), timeout, f"{task_id} to begin")


def executions(task_id: str) -> list[str]:
    from demoapp.tasks import runs

    return [e.split(":")[0] for e in runs(task_id)]


def ledger_emptied() -> None:
    # The result is stored by the pool process; the entry goes a moment later, at the main process's ack.
    wait_for(lambda: Ledger(client(), Keys.current()).count() == 0, 15, "every ledger entry to be released")


def sweep_until_recovered(task_ids: set[str], timeout: float = 20) -> dict[str, sweep.Outcome]:
    """Sweep until every task was recovered (a killed worker's lease takes a moment to lapse)."""
    recovered: dict[str, sweep.Outcome] = {}

    def attempt() -> bool:
        for o in sweep_now().outcomes:
            if o.decision.task_id in task_ids and o.done and o.decision.action is Action.RECOVER:
                recovered[o.decision.task_id] = o
        return set(recovered) == task_ids

    wait_for(attempt, timeout, f"{len(task_ids)} tasks to be recovered", interval=0.3)
    return recovered


def test_killed_worker_restarted_under_its_name_runs_the_task_again_with_the_same_id(
    workers: Any, amqp_broker: str
) -> None:
    from demoapp.tasks import summarize

    worker = workers.start("rmq-same@test", env=on(amqp_broker))
    result = summarize.delay([1, 2, 3], seconds=4)
    begun(result.id)
    worker.kill()
    restarted = workers.start("rmq-same@test", env=on(amqp_broker))

    # RabbitMQ hands the restarted worker the original again: dropped while the killed boot's lease lives,
    # counted as the recovery once it has lapsed; the sweep recovers it from the ledger otherwise.
    wait_for(lambda: (sweep_now(), result.ready())[1], 30, "the task to run again", interval=0.3)

    assert result.get(timeout=30) == 6
    assert TaskResult.objects.get(task_id=result.id).status == "SUCCESS"
    assert executions(result.id) == ["start", "start", "finish"]
    assert "rmq-same@test" in restarted.log() and result.id in restarted.log()
    ledger_emptied()


def test_worker_that_never_returns_is_recovered_onto_another_and_the_redelivered_original_is_dropped(
    workers: Any, amqp_broker: str
) -> None:
    from demoapp.tasks import summarize

    doomed = workers.start("rmq-doomed@test", env=on(amqp_broker), queues=("rmq-solo",))
    workers.start("rmq-other@test", env=on(amqp_broker))
    result = summarize.apply_async(([4, 5],), {"seconds": 4}, queue="rmq-solo")
    begun(result.id)
    doomed.kill()

    [outcome] = sweep_until_recovered({result.id}).values()
    assert outcome.decision.evidence is Evidence.LEASE_LAPSED
    # Both copies now wait in the queue: RabbitMQ's redelivery of the original and the recovered one.
    survivor = workers.start("rmq-survivor@test", env=on(amqp_broker), queues=("rmq-solo",))

    assert result.get(timeout=30) == 9
    assert TaskResult.objects.get(task_id=result.id).worker == "rmq-survivor@test"
    # By its fence, or by its row if the recovered copy ran first and stored SUCCESS.
    wait_for(lambda: dropped_a_stale_copy(survivor.log()), 20, "the redelivered original to be dropped")
    assert executions(result.id) == ["start", "start", "finish"]
    assert OrphanEvent.objects.get(task_id=result.id).attempt == 1


@pytest.mark.parametrize("order", ["sweep-then-restart", "restart-then-sweep"])
def test_rabbitmq_redelivery_and_our_recovery_together_never_run_a_task_twice(
    order: str, workers: Any, amqp_broker: str
) -> None:
    from demoapp.tasks import summarize

    worker = workers.start("rmq-many@test", env=on(amqp_broker), concurrency=4)
    results = [summarize.delay([i], seconds=3) for i in range(4)]
    for r in results:
        begun(r.id)
    worker.kill()
    ids = {r.id for r in results}

    if order == "sweep-then-restart":
        sweep_until_recovered(ids)
        workers.start("rmq-many@test", env=on(amqp_broker), concurrency=4)
    else:
        workers.start("rmq-many@test", env=on(amqp_broker), concurrency=4)
        # RabbitMQ's redeliveries are dropped while the killed boot's lease lives, or counted after.
        wait_for(
            lambda: (sweep_now(), all(r.ready() for r in results))[1],
            40,
            "every task to run again",
            interval=0.3,
        )

    assert sorted(r.get(timeout=40) for r in results) == [0, 1, 2, 3]
    for _ in range(2):
        sweep_now()  # nothing left that a sweep could send again
    for r in results:
        assert executions(r.id).count("finish") == 1, executions(r.id)
        assert executions(r.id).count("start") == 2, executions(r.id)
    assert set(TaskResult.objects.filter(task_id__in=ids).values_list("status", flat=True)) == {"SUCCESS"}
    ledger_emptied()
    if order == "sweep-then-restart":
        recovered = OrphanEvent.objects.filter(task_id__in=ids, action="recovered")
        assert Counter(recovered.values_list("task_id", flat=True)) == Counter(ids)


def test_poison_task_on_rabbitmq_ends_terminal_after_max_attempts(workers: Any, amqp_broker: str) -> None:
    from demoapp.tasks import poison

    result = poison.delay()  # @recoverable(max_attempts=2); kills its worker every time
    worker = workers.start("rmq-poison@test", env=on(amqp_broker))

    def failed() -> bool:
        return TaskResult.objects.filter(task_id=result.id, status="FAILURE").exists()

    for _ in range(5):
        # At the cap the task is marked terminal instead of run, and the worker lives on. RabbitMQ hands
        # the restarted worker the task again at once: counted if the killed boot's lease has lapsed,
        # dropped while it lives, and then recovered from the ledger by a sweep.
        wait_for(
            lambda w=worker: (sweep_now(), not w.is_running() or failed())[1],
            30,
            "the poison task to kill its worker",
            interval=0.3,
        )
        if failed():
            break
        worker = workers.start("rmq-poison@test", env=on(amqp_broker))  # restarted in place, as systemd would

    assert TaskResult.objects.get(task_id=result.id).status == "FAILURE", executions(result.id)
    assert OrphanEvent.objects.filter(task_id=result.id, action="recovered").count() == 2
    assert executions(result.id).count("start") == 3
    assert OrphanEvent.objects.filter(task_id=result.id).latest("id").action == "marked_terminal"


def test_messages_handed_over_before_the_worker_is_ready_are_admitted_under_its_lease(
    workers: Any, amqp_broker: str, redis_client: Any
) -> None:
    from demoapp.tasks import summarize

    # Queued before the worker exists. A worker subscribes to its queues one by one, and RabbitMQ hands
    # over the first queue's messages while the worker waits for the second subscription to be
    # confirmed: before the worker says it is ready.
    results = [summarize.delay([n], seconds=3) for n in range(3)]
    workers.start("rmq-early@test", env=on(amqp_broker), concurrency=2, queues=("celery", "later"))
    for result in results[:2]:
        begun(result.id)

    entries = Ledger(client(), Keys.current()).load([r.id for r in results[:2]])
    for entry in entries.values():
        assert isinstance(entry, Entry)
        assert entry.node == "rmq-early@test"
        assert redis_client.exists(Keys.current().lease(entry.node, entry.boot))
    assert [r.get(timeout=30) for r in results] == [0, 1, 2]


@pytest.mark.parametrize("outcome", ["SUCCESS", "FAILURE"])
def test_a_redelivery_of_a_task_whose_result_is_stored_and_whose_ack_was_lost_is_dropped(
    workers: Any, amqp_broker: str, outcome: str
) -> None:
    """The body ended and stored its outcome, the worker acknowledged and released its entry, but the ack
    never reached RabbitMQ (its connection went dark, then was cut): the broker delivers the message again.
    Before, the admission found no entry and admitted it as new: a task that had failed ran again (one that
    had succeeded was caught in the pool process by Celery's ``worker_deduplicate_successful_tasks``, when
    it is on). Now the worker's main process drops it, its row being ready."""
    from urllib.parse import urlsplit

    from demoapp.tasks import count_steps, summarize

    from tests.helpers import finishes, started_on, starts
    from tests.services import TcpProxy

    parts = urlsplit(amqp_broker)
    proxy = TcpProxy(parts.port or 5672)
    proxied = parts._replace(netloc=f"{parts.netloc.rsplit(':', 1)[0]}:{proxy.port}").geturl()
    try:
        workers.start("rmq-lost-ack@test", env=on(proxied))
        if outcome == "SUCCESS":
            result = summarize.delay([2, 3], seconds=1.5)
        else:
            result = count_steps.delay(3, seconds=0.5, fail_at=3)  # fails after 1 s
        started_on(result.id, "rmq-lost-ack@test")
        proxy.blackhole()  # the broker link alone: the ack is held, the ledger and the database are not
        wait_for(lambda: TaskResult.objects.filter(task_id=result.id, status=outcome).exists(), 20)
        ledger_emptied()  # acknowledged, as far as the worker knows: its entry released
        proxy.cut()  # the held ack is lost with the connection; RabbitMQ puts the message back
        other = workers.start("rmq-after-lost-ack@test", env=on(amqp_broker))
        wait_for(lambda: f"[{result.id}] received" in other.log(), 20, "the redelivery")
        wait_for(lambda: starts(result.id) == 2 or "dropped a redelivery" in other.log(), 20, "its fate")
        log = other.log()
    finally:
        proxy.close()
    assert starts(result.id) == 1, "the task ran again after it ended"
    assert finishes(result.id) == (1 if outcome == "SUCCESS" else 0)
    assert f"[{result.id}]: its result row already says {outcome}" in log
    assert TaskResult.objects.get(task_id=result.id).status == outcome
    assert not OrphanEvent.objects.filter(task_id=result.id).exists()
