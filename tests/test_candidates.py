"""What the sweep finds running (sweep/candidates.py): result rows and ledger entries, merged by task id."""

from __future__ import annotations

from datetime import timedelta

import pytest
from celery import current_app
from django.utils import timezone
from django_celery_results.models import TaskResult

from celery_orphans import endings, registry
from celery_orphans.ledger import Ledger
from celery_orphans.store import Keys, client
from celery_orphans.sweep import candidates
from celery_orphans.sweep.values import BootScope
from tests import factories

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("redis_client")]


def ledger() -> Ledger:
    return Ledger(client(), Keys.current())


def by_id(found: list) -> dict:
    return {c.task_id: c for c in found}


def test_a_row_an_entry_and_both_are_one_candidate_each_merged_by_task_id():
    registry.load_tasks(current_app)  # as a sweep does first: the task's policy is read from it
    both = factories.orphan()
    row_only = factories.orphan(entry=False)
    entry_only = factories.orphan(row=False)

    found, entries = candidates.gather(current_app, ledger(), None)

    seen = by_id(found)
    assert set(seen) == {both, row_only, entry_only}
    assert set(entries) == {both, entry_only}
    assert (seen[both].has_entry, seen[both].row_status, seen[both].boot) == (True, "STARTED", "dead-boot")
    assert (seen[row_only].has_entry, seen[row_only].boot) == (False, None)
    assert (seen[entry_only].row_status, seen[entry_only].worker) == (None, factories.GHOST)
    assert all(c.recoverable and c.task_known for c in found)  # demoapp.summarize is @recoverable


def test_a_cutoff_leaves_out_what_started_after_it_and_only_keeps_the_chosen_ids():
    old, recent = factories.orphan(started_ago=120), factories.orphan(started_ago=1)
    other_old = factories.orphan(started_ago=120)

    found, _ = candidates.gather(current_app, ledger(), timezone.now() - timedelta(seconds=60))
    chosen, _ = candidates.gather(current_app, ledger(), None, only=frozenset({recent}))

    assert set(by_id(found)) == {old, other_old}
    assert set(by_id(chosen)) == {recent}


def test_a_row_and_an_entry_that_disagree_on_the_task_make_a_candidate_with_a_problem():
    task_id = factories.orphan()
    TaskResult.objects.filter(task_id=task_id).update(task_name="demoapp.scan")

    [found], _ = candidates.gather(current_app, ledger(), None)

    assert found.problem == "the result row says 'demoapp.scan' but the ledger entry says 'demoapp.summarize'"


def test_at_boot_only_the_tasks_of_this_node_name_recorded_before_the_boot_are_candidates():
    mine = factories.orphan(worker="me@test", started_ago=30)
    factories.orphan(worker="other@test", started_ago=30)
    scope = BootScope("me@test", "new-boot", timezone.now(), held=lambda: frozenset({"held-now"}))

    found, _, views = candidates.own_tasks(current_app, ledger(), scope)

    assert [c.task_id for c in found] == [mine]
    view = views["me@test"]
    assert (view.replied, view.held, view.fresh_boots, view.at_boot) == (
        True,
        frozenset({"held-now"}),
        frozenset({"new-boot"}),
        True,
    )


def test_a_row_left_by_an_execution_that_ended_without_a_state_is_no_candidate_until_a_later_start():
    ended, restarted, elsewhere = (factories.orphan(entry=False, started_ago=30) for _ in range(3))
    for task_id in (ended, restarted, elsewhere):
        node = factories.GHOST if task_id != elsewhere else "another@test"
        endings.write(client(), Keys.current(), task_id, node, ttl=60)
    # A later execution of the same id (a replacement's last task, a requeued message) has started since.
    TaskResult.objects.filter(task_id=restarted).update(date_started=timezone.now() + timedelta(seconds=5))

    found, _ = candidates.gather(current_app, ledger(), None)

    assert set(by_id(found)) == {restarted, elsewhere}


def test_a_task_asked_about_that_ended_without_a_state_since_the_first_read_is_no_candidate():
    ended, running, not_asked = (factories.orphan(entry=False, started_ago=30) for _ in range(3))
    found, _ = candidates.gather(current_app, ledger(), None)
    assert set(by_id(found)) == {ended, running, not_asked}
    # While its node is asked, the execution of one ends with Ignore: the node answers without it.
    for task_id in (ended, not_asked):
        endings.write(client(), Keys.current(), task_id, factories.GHOST, ttl=60)

    left = candidates.ended_since(ledger(), found, {ended, running})

    assert set(by_id(left)) == {running, not_asked}


def test_an_entry_released_between_the_sweeps_two_reads_leaves_no_candidate_of_a_finished_task():
    task_id = factories.orphan()
    TaskResult.objects.filter(task_id=task_id).update(status="SUCCESS")  # before the rows are read
    found = candidates.find(ledger(), None)
    ledger().release(task_id, ledger().load([task_id])[task_id].token)  # before the entries are

    merged, _ = candidates.merge(current_app, ledger(), found)

    assert found.ledger_ids == [task_id] and merged == []


def test_a_row_of_a_replaced_task_and_the_entry_of_its_replacement_are_no_disagreement():
    task_id = factories.orphan(started_ago=30, entry=False)  # the original, ended by replace()
    made = factories.delivery("demoapp.collect", task_id, ([1],))
    ledger().admit_delivery(factories.ledger_entry(made, recorded_at=timezone.now().timestamp()))

    [found], _ = candidates.gather(current_app, ledger(), None)

    assert (found.problem, found.task_name, found.has_entry) == (None, "demoapp.collect", True)
