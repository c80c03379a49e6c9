"""Lifting a task's recovery cap from the admin: real Redis, a real worker, PostgreSQL, a pool process
killed by SIGKILL; and nobody without the permission can lift it."""

from __future__ import annotations

import time

import pytest
from celery.result import AsyncResult
from django.contrib.auth.models import Permission
from django.urls import reverse
from django_celery_results.models import TaskResult

from celery_orphans.decision import Action, Evidence
from celery_orphans.exceptions import RecoveryLimitReached
from celery_orphans.models import OrphanEvent
from celery_orphans.store import Keys
from tests.helpers import finishes, starts, sweep_now, sweep_until, wait_for

CHANGELIST = reverse("admin:celery_orphans_orphanevent_changelist")


def user_with(django_user_model, name: str, *codenames: str):
    user = django_user_model.objects.create_user(name, password="pw", is_staff=True)
    user.user_permissions.set(
        Permission.objects.filter(content_type__app_label="celery_orphans", codename__in=codenames)
    )
    return user


def lift(client, event: OrphanEvent) -> list[str]:
    """Choose the event on the audit list and run the lift action on it; the messages the admin shows."""
    response = client.post(
        CHANGELIST, {"action": "lift_recovery_cap", "_selected_action": [event.pk]}, follow=True
    )
    assert response.status_code == 200
    return [str(m) for m in response.context["messages"]]


def swept_ids() -> set[str]:
    return {o.decision.task_id for o in sweep_now().outcomes}


def actions_of(task_id: str) -> list[str]:
    return list(OrphanEvent.objects.filter(task_id=task_id).order_by("id").values_list("action", flat=True))


@pytest.mark.worker
def test_a_task_marked_terminal_at_its_cap_is_recovered_once_after_the_lift_and_not_before(
    workers, client, django_user_model, redis_client
):
    from demoapp.tasks import lose_pool_process

    workers.start("capped@test")
    # @recoverable(max_attempts=2), killing its pool process on its first 3 runs: the third loss hits the
    # cap, and the worker marks it terminal. The cause is then "fixed": a fourth run survives.
    result = lose_pool_process.delay(times=3)
    with pytest.raises(RecoveryLimitReached):
        result.get(timeout=40)
    assert starts(result.id) == 3
    [capped] = OrphanEvent.objects.filter(task_id=result.id, action="marked_terminal")
    assert (capped.reason, capped.attempt) == ("limit_reached", 2)
    # The message is kept, out of every sweep's sight.
    assert redis_client.hexists(Keys.current().entry(result.id), "capped")

    # Not before the lift: no sweep sees it, nothing runs it.
    for _ in range(3):
        assert result.id not in swept_ids()
    assert starts(result.id) == 3

    # A user who may see the log and recover orphans, but not lift a cap: not offered, and a post of the
    # action does nothing.
    client.force_login(user_with(django_user_model, "viewer", "view_orphanevent", "recover_orphans"))
    assert "lift_recovery_cap" not in client.get(CHANGELIST).content.decode()
    assert lift(client, capped) == []  # no action of theirs: the post only shows the list again
    assert result.id not in swept_ids()
    assert TaskResult.objects.get(task_id=result.id).status == "FAILURE"
    assert actions_of(result.id) == ["recovered", "recovered", "marked_terminal"]

    # With the permission: lifted, said, audited under the user's name.
    client.force_login(user_with(django_user_model, "operator", "view_orphanevent", "lift_recovery_cap"))
    assert "lift_recovery_cap" in client.get(CHANGELIST).content.decode()
    assert lift(client, capped) == [
        f"demoapp.lose_pool_process[{result.id}]: recovery cap lifted after 2 recoveries; the next sweep "
        "sends it again, once."
    ]
    [lifted] = OrphanEvent.objects.filter(task_id=result.id, action="cap_lifted")
    assert (lifted.trigger, lifted.triggered_by, lifted.attempt, lifted.worker) == (
        "admin",
        "operator",
        2,
        "capped@test",
    )
    assert TaskResult.objects.get(task_id=result.id).status == "RETRY"

    # The next sweep recovers it, though the worker that lost it is alive (it lost a pool process), and
    # the worker runs it, though it had flagged the task revoked when it marked it terminal.
    outcome = sweep_until(result.id, Action.RECOVER)
    assert (outcome.decision.attempt, outcome.decision.evidence) == (3, Evidence.CAP_LIFTED)
    assert outcome.decision.detail == "recovery 3 of 3 (its cap lifted by an operator)"
    assert AsyncResult(result.id).get(timeout=30) == "survived"
    assert (starts(result.id), finishes(result.id)) == (4, 1)

    # Exactly once: nothing is left to sweep, and a second lift has nothing to lift. The worker removes the
    # finished run's entry after its acknowledgement, from its outbox: a sweep at once may still list it
    # (CI's oldest combination did, once), and must leave it.
    wait_for(lambda: result.id not in swept_ids(), 10, "the finished run's entry to be removed")
    assert starts(result.id) == 4
    assert lift(client, capped) == [
        f"demoapp.lose_pool_process[{result.id}] is not marked terminal at its recovery cap (or its fence "
        "expired); nothing was changed."
    ]
    assert actions_of(result.id) == [
        "recovered",
        "recovered",
        "marked_terminal",
        "cap_lifted",
        "recovered",
        "refused",
    ]
    assert starts(result.id) == 4


@pytest.mark.django_db
def test_the_lift_is_refused_for_a_task_marked_terminal_for_another_reason(
    client, django_user_model, redis_client
):
    from tests import factories

    task_id = factories.orphan("demoapp.scan", ("db",))
    sweep_now()  # not recoverable: marked terminal, its message not kept
    [terminal] = OrphanEvent.objects.filter(task_id=task_id, action="marked_terminal")
    client.force_login(user_with(django_user_model, "operator", "view_orphanevent", "lift_recovery_cap"))

    assert lift(client, terminal) == [
        f"demoapp.scan[{task_id}] was marked terminal, but its message is not kept: only a task marked "
        "terminal at its recovery cap (limit_reached) can be recovered again; nothing was changed."
    ]
    assert TaskResult.objects.get(task_id=task_id).status == "FAILURE"
    assert actions_of(task_id) == ["marked_terminal", "refused"]


@pytest.mark.django_db
def test_the_lift_is_refused_while_recovery_is_switched_off(
    client, django_user_model, settings, redis_client
):
    task_id = "t-1"
    event = OrphanEvent.objects.create(
        task_id=task_id, action="marked_terminal", reason="limit_reached", trigger="beat"
    )
    settings.CELERY_ORPHANS_ENABLED = False
    client.force_login(user_with(django_user_model, "operator", "view_orphanevent", "lift_recovery_cap"))

    assert lift(client, event) == [
        "Lift the recovery cap: nothing was done: CELERY_ORPHANS_ENABLED is off: nothing was changed"
    ]


@pytest.mark.worker
def test_a_task_that_kills_its_worker_is_sent_exactly_once_more_per_lift(workers, redis_client):
    from demoapp.tasks import poison

    from celery_orphans import operations
    from celery_orphans.choices import Trigger

    result = poison.delay()  # @recoverable(max_attempts=2), kills the worker running it every time
    worker = workers.start("poisoned@test")
    decided = []
    for _ in range(3):
        wait_for(lambda w=worker: not w.is_running(), 20, "the poison task to kill its worker")
        worker = workers.start("poisoned@test")  # restarted in place, as systemd would
        decided.append(sweep_until(result.id, Action.RECOVER, Action.MARK_TERMINAL).decision)
    assert [(d.action, d.attempt) for d in decided] == [
        (Action.RECOVER, 1),
        (Action.RECOVER, 2),
        (Action.MARK_TERMINAL, 2),
    ]
    assert result.id not in swept_ids()  # the sweep's terminal mark kept its message out of sight too

    [lifted] = operations.lift_caps([result.id], trigger=Trigger.API, user="alice")

    assert lifted.lifted, lifted.message
    again = sweep_until(result.id, Action.RECOVER).decision
    assert (again.attempt, again.evidence) == (3, Evidence.CAP_LIFTED)
    # It kills its worker once more; the next sweep marks it terminal at the lifted count.
    wait_for(
        lambda: starts(result.id) == 4 and not worker.is_running(), 20, "the lifted run to kill its worker"
    )
    workers.start("poisoned@test")
    final = sweep_until(result.id, Action.MARK_TERMINAL).decision
    assert (final.reason.value, final.detail) == ("limit_reached", "already recovered 3 of 3 times")
    assert starts(result.id) == 4
    assert result.id not in swept_ids()


@pytest.mark.worker
def test_a_lift_is_kept_until_the_next_sweep_through_the_window_s_end_and_its_worker_s_late_release(
    workers, redis_client
):
    """The lift keeps the message, and the lifted cap, for the next sweep however long that takes. Before,
    a lift late in the window lost its fence (and the lifted cap) before the next sweep; and the release
    the worker queued for the capped delivery, landing after the lift (its outbox sends it after the
    acknowledgement: 1 run in 4 here), took the message away. Either way a task capped by pool losses, its
    worker alive, was left RETRY for as long as that worker lived."""
    from demoapp.tasks import lose_pool_process

    from celery_orphans import operations
    from celery_orphans.choices import Trigger
    from celery_orphans.ledger import ledger_for

    workers.start("late@test")
    result = lose_pool_process.delay(times=3)
    with pytest.raises(RecoveryLimitReached):
        result.get(timeout=40)
    keys = Keys.current()
    capped_token = redis_client.hget(keys.entry(result.id), "token").decode()
    # The terminal mark was made most of a window ago: its fence and its kept message have 6 s left.
    for key in (keys.fence(result.id), keys.entry(result.id)):
        assert redis_client.pexpire(key, 6000)
    window_ends = time.monotonic() + 6

    [lifted] = operations.lift_caps([result.id], trigger=Trigger.API, user="alice")
    assert lifted.lifted, lifted.message
    # The worker's release of the capped delivery, held up until now, lands on nothing.
    assert not ledger_for().release(result.id, capped_token)
    time.sleep(max(0.0, window_ends - time.monotonic()) + 0.5)  # the window passes before any sweep

    outcome = sweep_until(result.id, Action.RECOVER)
    assert (outcome.decision.attempt, outcome.decision.evidence) == (3, Evidence.CAP_LIFTED)
    assert AsyncResult(result.id).get(timeout=30) == "survived"
    assert (starts(result.id), finishes(result.id)) == (4, 1)
    # The run's worker removes its entry after the acknowledgement; then nothing is left to sweep.
    wait_for(lambda: not redis_client.exists(keys.entry(result.id)), 10, "the entry to be released")
    assert result.id not in swept_ids()


@pytest.mark.worker
def test_a_lift_made_while_a_worker_with_a_state_db_was_down_is_run_by_it(workers, tmp_path):
    """A worker started with --statedb keeps its revoked set across restarts, so a worker that was down
    when the cap was lifted came back with the revoke of the terminal mark the lift took back on the
    others. Before, it dropped the lift's copy as revoked: the task ended REVOKED, 3 starts and no run
    after the lift, while the audit said it was sent again. Now the copy runs, once."""
    from demoapp.tasks import lose_pool_process

    from celery_orphans import operations
    from celery_orphans.choices import Trigger
    from tests.workers import LEAN_FLAGS

    flags = (*LEAN_FLAGS, f"--statedb={tmp_path / 'worker.state'}")
    worker = workers.start("stated@test", flags=flags)
    result = lose_pool_process.delay(times=3)
    with pytest.raises(RecoveryLimitReached):
        result.get(timeout=40)
    worker.stop()  # its revoked set, with this task, is saved

    [lifted] = operations.lift_caps([result.id], trigger=Trigger.API, user="alice")  # no worker is up
    assert lifted.lifted, lifted.message
    workers.start("stated@test", flags=flags)

    outcome = sweep_until(result.id, Action.RECOVER)
    assert (outcome.decision.attempt, outcome.decision.evidence) == (3, Evidence.CAP_LIFTED)
    assert AsyncResult(result.id).get(timeout=30) == "survived"
    assert (starts(result.id), finishes(result.id)) == (4, 1)
    assert TaskResult.objects.get(task_id=result.id).status == "SUCCESS"
