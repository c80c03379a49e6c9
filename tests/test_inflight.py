"""What a load of the in-flight page costs: one dry run shared by every viewer for a few seconds, a page
of tasks at a time, no broadcast to the workers unless asked; actions and worker queries limited per
user."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from django.db import connection
from django.urls import reverse
from django_celery_results.models import TaskResult

from celery_orphans import inflight, operations
from celery_orphans.choices import Trigger
from celery_orphans.models import OrphanEvent
from celery_orphans.sweep import liveness
from celery_orphans.worker.heartbeat import Heartbeat
from tests import factories

IN_FLIGHT = reverse("admin:celery_orphans_inflight")
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("redis_client")]


@pytest.fixture
def shared(settings: Any) -> None:
    settings.CELERY_ORPHANS_IN_FLIGHT_CACHE_SECONDS = 60


@pytest.fixture
def dry_runs(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each dry run behind the page asked the workers, one item per dry run."""
    runs: list[bool] = []
    real = operations.run

    def counted(options: Any, *args: Any) -> Any:
        runs.append(options.ask_workers)
        return real(options, *args)

    monkeypatch.setattr(operations, "run", counted)
    return runs


def shown(judged: inflight.Judged) -> list[str]:
    return [row.outcome.decision.task_id for row in judged.rows]


@pytest.mark.usefixtures("shared")
def test_loads_within_a_few_seconds_share_one_dry_run_until_an_operator_acts(
    admin_client: Any, dry_runs: list[bool]
) -> None:
    first = factories.orphan()
    assert shown(operations.in_flight(Trigger.ADMIN)) == [first]
    second = factories.orphan(started_ago=30)

    assert shown(operations.in_flight(Trigger.ADMIN)) == [first]  # the shared verdicts, not a new run
    assert dry_runs == [False]

    admin_client.post(IN_FLIGHT, {"action": "mark_terminal", "task_id": [first]})

    assert shown(operations.in_flight(Trigger.ADMIN)) == [second]


@pytest.mark.usefixtures("shared")
def test_loads_at_the_same_time_wait_for_one_dry_run_instead_of_each_running_one(
    dry_runs: list[bool],
) -> None:
    orphans = {factories.orphan() for _ in range(3)}
    pages: list[inflight.Judged] = []

    def load() -> None:
        try:
            pages.append(operations.in_flight(Trigger.ADMIN))
        finally:
            connection.close()  # each thread's own; a session left open outlives the test

    threads = [threading.Thread(target=load) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)

    assert dry_runs == [False]
    assert [set(shown(page)) for page in pages] == [orphans] * 4


@pytest.mark.parametrize("sharing", [0, 60])
def test_the_page_shows_one_page_of_tasks_oldest_first_and_counts_them_all(
    sharing: int, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings.CELERY_ORPHANS_IN_FLIGHT_CACHE_SECONDS = sharing
    monkeypatch.setattr(inflight, "PAGE_SIZE", 2)
    oldest_first = [factories.orphan(started_ago=100 - i) for i in range(5)]

    pages = [operations.in_flight(Trigger.ADMIN, page=p) for p in (1, 2, 3, 4)]

    assert [shown(p) for p in pages] == [
        oldest_first[:2],
        oldest_first[2:4],
        oldest_first[4:],
        oldest_first[4:],
    ]
    assert {(p.total, p.pages, p.page) for p in pages[:1]} == {(5, 3, 1)}
    assert pages[3].page == 3  # past the end: the last page
    assert pages[0].counts == [("will recover", 5)]


def test_the_workers_are_asked_only_when_a_viewer_asks(
    admin_client: Any, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings.CELERY_ORPHANS_LEASE_SECONDS = 60
    Heartbeat("busy@test", boot="b1").renew()
    only_a_row = factories.orphan(worker="busy@test", entry=False)
    asked: list[frozenset[str]] = []
    real = liveness.ask_workers

    def spy(app: Any, nodes: Any, question: frozenset[str], timeout: float) -> Any:
        asked.append(question)
        return real(app, nodes, question, 0.05)

    monkeypatch.setattr(liveness, "ask_workers", spy)

    plain = admin_client.get(IN_FLIGHT)
    assert asked == []
    assert "ask them" in plain.content.decode()
    [row] = plain.context["rows"]
    assert (row.outcome.decision.task_id, row.label) == (only_a_row, "alive")

    admin_client.get(IN_FLIGHT, {"ask": "1"})
    assert asked == [frozenset({only_a_row})]


def test_actions_and_worker_queries_are_limited_per_user_across_the_admin_and_the_api(
    admin_client: Any, admin_user: Any
) -> None:
    orphans = [factories.orphan() for _ in range(7)]
    for task_id in orphans[:3]:
        admin_client.post(IN_FLIGHT, {"action": "mark_terminal", "task_id": [task_id]})
    admin_client.get(IN_FLIGHT, {"ask": "1"})
    admin_client.post(
        reverse("celery_orphans:sweep"), {"task_ids": [orphans[3]]}, content_type="application/json"
    )

    refused = admin_client.post(IN_FLIGHT, {"action": "mark_terminal", "task_id": [orphans[4]]}, follow=True)
    api = admin_client.post(reverse("celery_orphans:sweep"), {}, content_type="application/json")

    assert any("at most 5 actions or worker queries in 60 s" in str(m) for m in refused.context["messages"])
    assert TaskResult.objects.get(task_id=orphans[4]).status == "STARTED"
    assert api.status_code == 429
    mine = OrphanEvent.objects.filter(triggered_by=admin_user.username)
    assert sorted(mine.values_list("action", flat=True)) == sorted(
        ["marked_terminal"] * 3 + ["recovered", "refused"]
    )
    [refusal] = mine.filter(action="refused")  # audited once per window, not at every refused request
    assert refusal.reason == "rate_limited"
