"""Shadow mode, the age limit, the per-sweep limit and the refusal of unsafe messages."""

from __future__ import annotations

import pytest
from django_celery_results.models import TaskResult

from celery_orphans import sweep
from celery_orphans.decision import Action, Reason
from celery_orphans.ledger import Ledger
from celery_orphans.models import OrphanEvent, Trigger
from celery_orphans.store import Keys, client
from tests import factories

pytestmark = pytest.mark.django_db(transaction=True)


def run(**kwargs: object) -> sweep.Report:
    return sweep.run(sweep.Options(trigger=Trigger.COMMAND, grace_seconds=0, **kwargs))


def decisions(report: sweep.Report) -> dict[str, tuple[Action, Reason]]:
    return {o.decision.task_id: (o.decision.action, o.decision.reason) for o in report.outcomes}


def test_shadow_mode_audits_what_it_would_do_once_and_changes_nothing_else(redis_client, settings):
    settings.CELERY_ORPHANS_SHADOW_MODE = True
    recoverable = factories.orphan("demoapp.summarize")
    scan = factories.orphan("demoapp.scan", ("db",))

    for _ in range(3):
        report = run()

    assert {o.decision.action for o in report.outcomes} == {Action.RECOVER, Action.MARK_TERMINAL}
    assert sorted(OrphanEvent.objects.values_list("action", flat=True)) == [
        "would_mark_terminal",
        "would_recover",
    ]
    assert set(TaskResult.objects.values_list("status", flat=True)) == {"STARTED"}
    assert Ledger(client(), Keys.current()).attempts([recoverable, scan]) == {recoverable: 0, scan: 0}
    assert redis_client.llen("celery") == 0
    assert "would have recovered 1" in report.summary()


def test_orphan_older_than_the_age_limit_is_marked_terminal_not_resurrected(redis_client, settings):
    settings.CELERY_ORPHANS_MAX_ORPHAN_AGE_SECONDS = 3600
    old = factories.orphan(started_ago=7200)
    young = factories.orphan(started_ago=60)

    found = decisions(run())

    assert found[old] == (Action.MARK_TERMINAL, Reason.TOO_OLD)
    assert found[young] == (Action.RECOVER, Reason.RECOVERABLE)
    assert TaskResult.objects.get(task_id=old).status == "FAILURE"
    assert redis_client.llen("celery") == 1


def test_after_a_mass_failure_each_sweep_recovers_at_most_the_limit_oldest_first(redis_client, settings):
    settings.CELERY_ORPHANS_MAX_RECOVERIES_PER_SWEEP = 2
    ids = [factories.orphan(started_ago=600 - i) for i in range(5)]  # ids[0] is the oldest

    first = decisions(run())
    second = decisions(run())

    assert [first[i] for i in ids[:2]] == [(Action.RECOVER, Reason.RECOVERABLE)] * 2
    assert [first[i] for i in ids[2:]] == [(Action.LEAVE, Reason.DEFERRED)] * 3
    assert [second[i] for i in ids[2:4]] == [(Action.RECOVER, Reason.RECOVERABLE)] * 2
    assert second[ids[4]] == (Action.LEAVE, Reason.DEFERRED)


def test_pickled_message_is_never_sent_again_and_does_not_stop_the_sweep(redis_client):
    pickled = factories.orphan(content_type="application/x-python-serialize")
    fine = factories.orphan()

    found = decisions(run())

    assert found[pickled] == (Action.MARK_TERMINAL, Reason.UNSAFE_MESSAGE)
    assert found[fine] == (Action.RECOVER, Reason.RECOVERABLE)
    assert redis_client.llen("celery") == 1


def test_an_operator_selection_judges_only_the_chosen_tasks(redis_client):
    chosen, other = factories.orphan(), factories.orphan()

    found = decisions(run(task_ids=frozenset({chosen})))

    assert set(found) == {chosen}
    assert TaskResult.objects.get(task_id=other).status == "STARTED"


def test_an_operator_can_close_a_recoverable_orphan_instead_of_recovering_it(redis_client):
    task_id = factories.orphan()

    found = decisions(run(task_ids=frozenset({task_id}), mark_terminal=True))

    assert found[task_id] == (Action.MARK_TERMINAL, Reason.BY_OPERATOR)
    assert TaskResult.objects.get(task_id=task_id).status == "FAILURE"
    assert redis_client.llen("celery") == 0


def test_actions_outside_the_allowed_set_are_reported_but_not_carried_out(redis_client):
    recoverable, scan = factories.orphan(), factories.orphan("demoapp.scan", ("db",))

    report = run(acts=frozenset({Action.RECOVER}))

    done = {o.decision.task_id: o.done for o in report.outcomes}
    assert done == {recoverable: True, scan: False}
    assert TaskResult.objects.get(task_id=scan).status == "STARTED"
