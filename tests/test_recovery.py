"""End-to-end recovery with real workers, real Redis, PostgreSQL and SIGKILL."""

from __future__ import annotations

import base64
import json
import threading
from datetime import datetime, timezone
from decimal import Decimal

import pytest
from celery import chain, chord
from django.db import connection
from django_celery_results.models import TaskResult

from celery_orphans import leases
from celery_orphans.decision import Action, Evidence
from celery_orphans.exceptions import RecoveryLimitReached, SweepLocked, TaskOrphaned
from celery_orphans.ledger import Ledger
from celery_orphans.models import OrphanEvent
from celery_orphans.store import Keys, client
from tests.helpers import (
    dropped_a_stale_copy,
    finishes,
    outcome_of,
    started_on,
    starts,
    sweep_now,
    sweep_until,
    wait_for,
)

pytestmark = pytest.mark.worker


def as_bytes(body: bytes | str) -> bytes:
    """A stored body as the bytes a broker carries (a text body is UTF-8)."""
    return body.encode() if isinstance(body, str) else body


def test_killed_worker_restarted_under_same_name_runs_the_task_again_with_the_same_id(workers):
    from demoapp.tasks import summarize

    worker = workers.start("same@test")
    result = summarize.delay([1, 2, 3], seconds=3)
    started_on(result.id, "same@test")
    worker.kill()
    workers.start("same@test")

    outcome = sweep_until(result.id, Action.RECOVER)  # once the killed boot's lease has lapsed

    assert outcome.decision.evidence is Evidence.LEASE_LAPSED
    assert result.get(timeout=30) == 6
    assert TaskResult.objects.get(task_id=result.id).status == "SUCCESS"
    assert (starts(result.id), finishes(result.id)) == (2, 1)
    audit = OrphanEvent.objects.get(task_id=result.id)
    assert (audit.action, audit.attempt, audit.worker) == ("recovered", 1, "same@test")


def test_worker_that_never_returns_is_proven_gone_by_its_lease_and_the_task_runs_on_another(workers):
    from demoapp.tasks import summarize

    doomed = workers.start("doomed@test", queues=("solo-queue",))
    workers.start("other@test")
    result = summarize.apply_async(([4, 5],), {"seconds": 3}, queue="solo-queue")
    started_on(result.id, "doomed@test")
    doomed.kill()
    # The re-sent message goes where the original went: let the survivor consume that queue too.
    workers.start("survivor@test", queues=("solo-queue",))

    outcome = sweep_until(result.id, Action.RECOVER)

    assert outcome.decision.evidence is Evidence.LEASE_LAPSED
    assert result.get(timeout=30) == 9
    assert TaskResult.objects.get(task_id=result.id).worker == "survivor@test"


def test_resent_message_is_byte_for_byte_the_original_with_recovery_headers_added(workers, redis_client):
    from demoapp.tasks import echo

    worker = workers.start("bytes@test", queues=("held",))
    args = (
        "x" * 5000,
        datetime(2024, 2, 29, 12, 30, tzinfo=timezone.utc),
        Decimal("12.345678901234567890"),
        {"nested": {"list": [1, 2.5, None, "é"], "deep": {"k": True}}},
    )
    result = echo.apply_async(args, {"seconds": 5}, queue="held")
    started_on(result.id, "bytes@test")
    original = Ledger(client(), Keys.current()).load([result.id])[result.id]
    worker.kill()

    sweep_until(result.id, Action.RECOVER)

    [raw] = redis_client.lrange("held", 0, -1)
    payload = json.loads(raw)
    assert base64.b64decode(payload["body"]) == as_bytes(original.delivery.raw_body())
    headers = dict(payload["headers"])
    recovery = headers.pop("celery_orphans")
    assert headers == original.delivery.headers
    assert recovery["attempt"] == 1 and recovery["worker"] == "bytes@test"

    workers.start("reader@test", queues=("held",))
    returned = result.get(timeout=30)
    assert tuple(returned["args"]) == args
    assert returned["recovery"]["attempt"] == 1


def test_chain_whose_first_task_was_orphaned_completes(workers):
    from demoapp.tasks import add

    worker = workers.start("chain@test")
    result = chain(add.s(1, 2, seconds=3), add.s(10)).delay()
    first = result.parent
    started_on(first.id, "chain@test")
    worker.kill()
    workers.start("chain@test")

    sweep_until(first.id, Action.RECOVER)
    assert result.get(timeout=30) == 13
    assert starts(result.id) == 1


def test_chord_whose_member_was_orphaned_completes(workers):
    from demoapp.tasks import add, collect

    worker = workers.start("chord@test", concurrency=2)
    result = chord([add.s(1, 1), add.s(2, 2, seconds=4)], collect.s()).delay()
    slow_id = result.parent.results[1].id
    started_on(slow_id, "chord@test")
    wait_for(
        lambda: TaskResult.objects.filter(task_id=result.parent.results[0].id, status="SUCCESS").exists(),
        20,
        "the fast member to finish",
    )
    # Its row says SUCCESS before its part of the chord is counted: killed in between, the chord would never
    # complete (a window of Celery's own, see never-twice.md). Its entry goes once it was acknowledged.
    fast = Keys.current().entry(result.parent.results[0].id)
    wait_for(lambda: not client().exists(fast), 20, "the fast member to be acknowledged")
    worker.kill()
    workers.start("chord@test")

    sweep_until(slow_id, Action.RECOVER)
    assert result.get(timeout=30) == 6
    assert starts(result.id) == 1


def unacked_deliveries_of(redis_client, task_id: str) -> list[bytes]:
    """The tags the Redis transport holds unacknowledged for ``task_id`` (and restores after a while)."""
    return [
        tag
        for tag, payload in redis_client.hgetall("unacked").items()
        if json.loads(payload)[0]["headers"]["id"] == task_id
    ]


def test_non_recoverable_orphan_ends_failure_with_task_orphaned_and_never_runs_again(
    workers, redis_client, celery_app
):
    from demoapp.tasks import scan

    worker = workers.start("scan@test", concurrency=2)
    result = scan.delay("db-1", seconds=5)
    other = scan.delay("db-2", seconds=5)  # delivered to the same worker: one unacked hash, two tags
    started_on(result.id, "scan@test")
    started_on(other.id, "scan@test")
    [tag] = unacked_deliveries_of(redis_client, result.id)
    worker.kill()
    workers.start("scan@test")

    report = sweep_now()
    outcome = outcome_of(report, result.id)

    assert (outcome.decision.action, outcome.decision.reason.value) == (
        Action.MARK_TERMINAL,
        "not_recoverable",
    )
    assert result.state == "FAILURE"
    with pytest.raises(TaskOrphaned, match="scan@test"):
        result.get(timeout=5)
    assert starts(result.id) == 1
    # Without a ledger entry to name its tag, the dead delivery is found in the transport's hash and
    # removed, so the transport never restores it; the other orphan's goes with its own action.
    assert not redis_client.hexists("unacked", tag)
    assert unacked_deliveries_of(redis_client, result.id) == []
    assert outcome_of(report, other.id).done
    assert unacked_deliveries_of(redis_client, other.id) == []
    # And every worker is told to discard any copy of either, and leaves their rows as they were (Celery
    # 5.6's own revoke command would store REVOKED over them).
    revoked = celery_app.control.inspect(destination=["scan@test"], timeout=5).revoked() or {}
    assert {result.id, other.id} <= set(revoked.get("scan@test", []))
    assert set(
        TaskResult.objects.filter(task_id__in=[result.id, other.id]).values_list("status", flat=True)
    ) == {"FAILURE"}


def test_poison_task_is_recovered_exactly_max_attempts_times_then_ends_recovery_limit_reached(workers):
    from demoapp.tasks import poison

    result = poison.delay()  # @recoverable(max_attempts=2)
    worker = workers.start("poison@test")
    recoveries = 0
    for _ in range(4):
        wait_for(lambda w=worker: not w.is_running(), 20, "the poison task to kill its worker")
        worker = workers.start("poison@test")  # restarted in place, as systemd would
        outcome = sweep_until(result.id, Action.RECOVER, Action.MARK_TERMINAL)
        if outcome.decision.action is Action.MARK_TERMINAL:
            break
        assert outcome.decision.action is Action.RECOVER
        recoveries += 1

    assert recoveries == 2
    assert outcome.decision.reason.value == "limit_reached"
    with pytest.raises(RecoveryLimitReached):
        result.get(timeout=5)
    assert starts(result.id) == 3


def test_stale_copy_restored_by_the_transport_after_a_recovery_does_not_run(workers, redis_client):
    from demoapp.tasks import summarize

    worker = workers.start("fence@test")
    result = summarize.delay([7], seconds=4)
    started_on(result.id, "fence@test")
    [(tag, payload)] = redis_client.hgetall("unacked").items()
    worker.kill()
    workers.start("fence@test")
    sweep_until(result.id, Action.RECOVER)
    assert result.get(timeout=30) == 7
    # As if the sweep had died before removing the dead delivery: put it back, already past its
    # visibility timeout, and let a worker's transport restore it at boot.
    redis_client.hset("unacked", tag, payload)
    redis_client.zadd("unacked_index", {tag: 1})
    workers.start("restorer@test", env={"TESTPROJECT_VISIBILITY_TIMEOUT": "2"})

    # The restored copy is a redelivery of a task whose row already says SUCCESS: it is dropped by that
    # row, before its fence is read; either check keeps it from running.
    wait_for(lambda: any(dropped_a_stale_copy(w.log()) for w in workers), 20, "the stale copy to be dropped")
    assert not redis_client.hexists("unacked", tag)
    assert (starts(result.id), finishes(result.id)) == (2, 1)
    assert TaskResult.objects.get(task_id=result.id).status == "SUCCESS"


def test_solo_worker_running_a_long_task_is_never_recovered(workers):
    from demoapp.tasks import summarize

    workers.start("solo@test", pool="solo")
    result = summarize.delay([1], seconds=8)
    started_on(result.id, "solo@test")
    for _ in range(4):
        outcome = outcome_of(sweep_now(), result.id)
        assert outcome.decision.action is Action.LEAVE, outcome
    assert result.get(timeout=20) == 1
    assert starts(result.id) == 1
    assert not OrphanEvent.objects.exists()


def test_four_concurrent_sweeps_over_twenty_orphans_recover_each_exactly_once(workers):
    from demoapp.tasks import summarize

    worker = workers.start("many@test", pool="threads", concurrency=20)
    results = [summarize.delay([i], seconds=60) for i in range(20)]
    for r in results:
        started_on(r.id, "many@test")
    worker.kill()
    wait_for(lambda: not leases.fresh_boots(["many@test"])["many@test"], 10, "the lease to lapse")

    errors: list[BaseException] = []

    def one_sweep() -> None:
        try:
            sweep_now()
        except SweepLocked:
            pass
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=one_sweep) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sweep_now()  # whatever the lock turned away is picked up now, and nothing twice

    assert not errors
    ids = [r.id for r in results]
    assert sorted(OrphanEvent.objects.filter(action="recovered").values_list("task_id", flat=True)) == sorted(
        ids
    )
    assert set(Ledger(client(), Keys.current()).attempts(ids).values()) == {1}
    assert client().llen("celery") == 20


def test_worker_restarted_under_its_name_recovers_its_previous_boots_task_at_boot(workers):
    from demoapp.tasks import summarize

    worker = workers.start("boot@test")
    result = summarize.delay([2, 2], seconds=3)
    started_on(result.id, "boot@test")
    worker.kill()
    workers.start("boot@test", env={"CELERY_ORPHANS_BOOT_SWEEP": "true"})

    assert result.get(timeout=30) == 4  # no sweep was run by the test
    audit = OrphanEvent.objects.get(task_id=result.id)
    assert (audit.action, audit.evidence, audit.trigger) == ("recovered", "found_at_boot", "worker_boot")


def test_boot_sweep_leaves_tasks_alone_when_another_live_worker_shares_the_name(workers):
    from demoapp.tasks import summarize

    workers.start("twin@test", queues=("twin-a",))
    result = summarize.apply_async(([1],), {"seconds": 6}, queue="twin-a")
    started_on(result.id, "twin@test")
    twin = workers.start("twin@test", queues=("twin-b",), env={"CELERY_ORPHANS_BOOT_SWEEP": "true"})

    wait_for(lambda: "two workers share a name" in twin.log(), 15, "the shared-name warning")
    assert result.get(timeout=20) == 1
    assert starts(result.id) == 1
    assert not OrphanEvent.objects.exists()
