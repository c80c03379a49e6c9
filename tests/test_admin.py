"""The audit log in the admin: listed, searchable, linked to task results, and never changeable."""

from __future__ import annotations

import uuid

import pytest
from django.contrib.auth.models import Permission
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils.http import urlencode
from django_celery_results.models import TaskResult

from celery_orphans.models import OrphanEvent

CHANGELIST = reverse("admin:celery_orphans_orphanevent_changelist")


def event(task_id: str | None = None, **fields: object) -> OrphanEvent:
    values: dict[str, object] = {
        "task_id": task_id or str(uuid.uuid4()),
        "task_name": "demoapp.summarize",
        "worker": "w1@test",
        "action": "recovered",
        "reason": "recoverable",
        "evidence": "no_reply_lease_lapsed",
        "detail": "recovery 1 of 3",
        "attempt": 1,
        "trigger": "beat",
        **fields,
    }
    return OrphanEvent.objects.create(**values)


def staff_client(client, django_user_model, *codenames: str):
    user = django_user_model.objects.create_user("staff", password="pw", is_staff=True)
    user.user_permissions.set(
        Permission.objects.filter(content_type__app_label="celery_orphans", codename__in=codenames)
    )
    client.force_login(user)
    return client


@pytest.mark.django_db
def test_changelist_shows_every_column_of_an_event(admin_client):
    recorded = event(triggered_by="alice", worker="big@test", evidence="worker_answered_without_task")

    response = admin_client.get(CHANGELIST)

    assert response.status_code == 200
    page = response.content.decode()
    for text in (
        recorded.task_id,
        "demoapp.summarize",
        "big@test",
        "Recovered",
        "recoverable",
        "worker_answered_without_task",
        "Beat schedule",
        "alice",
    ):
        assert text in page


@pytest.mark.django_db
def test_staff_user_with_view_permission_sees_the_changelist(client, django_user_model):
    recorded = event()

    response = staff_client(client, django_user_model, "view_orphanevent").get(CHANGELIST)

    assert response.status_code == 200
    assert recorded.task_id in response.content.decode()


@pytest.mark.django_db
def test_staff_user_without_view_permission_is_refused(client, django_user_model):
    event()

    assert staff_client(client, django_user_model).get(CHANGELIST).status_code == 403


@pytest.mark.django_db
def test_search_by_task_id_finds_only_that_event(admin_client):
    wanted, other = event(), event()

    response = admin_client.get(CHANGELIST, {"q": wanted.task_id})

    page = response.content.decode()
    assert response.status_code == 200
    assert wanted.task_id in page
    assert other.task_id not in page


@pytest.mark.django_db
def test_filters_are_offered_and_narrow_the_list(admin_client):
    terminal = event(action="marked_terminal", reason="not_recoverable", trigger="command")
    recovered = event()

    response = admin_client.get(CHANGELIST, {"action__exact": "marked_terminal"})

    page = response.content.decode()
    assert terminal.task_id in page
    assert recovered.task_id not in page
    filters = response.context["cl"].list_filter
    assert list(filters) == ["action", "reason", "trigger", "task_name", "worker", "created_at"]


def _refused_views(pk: int) -> list[str]:
    return [
        reverse("admin:celery_orphans_orphanevent_add"),
        reverse("admin:celery_orphans_orphanevent_change", args=[pk]),
        reverse("admin:celery_orphans_orphanevent_delete", args=[pk]),
        reverse("admin:celery_orphans_orphanevent_history", args=[pk]),
    ]


@pytest.mark.django_db
def test_add_change_and_delete_are_refused_even_to_a_superuser(admin_client):
    recorded = event()

    for url in _refused_views(recorded.pk):
        assert admin_client.get(url).status_code == 403, url
    assert admin_client.post(reverse("admin:celery_orphans_orphanevent_add"), {}).status_code == 403
    delete = reverse("admin:celery_orphans_orphanevent_delete", args=[recorded.pk])
    assert admin_client.post(delete, {"post": "yes"}).status_code == 403
    assert OrphanEvent.objects.filter(pk=recorded.pk).exists()


@pytest.mark.django_db
def test_add_change_and_delete_are_refused_to_staff_holding_every_model_permission(client, django_user_model):
    recorded = event()
    staff = staff_client(
        client,
        django_user_model,
        "add_orphanevent",
        "change_orphanevent",
        "delete_orphanevent",
        "view_orphanevent",
        "recover_orphans",
    )

    for url in _refused_views(recorded.pk):
        assert staff.get(url).status_code == 403, url


@pytest.mark.django_db
def test_bulk_delete_is_not_offered(admin_client):
    recorded = event()

    response = admin_client.get(CHANGELIST)
    assert "delete_selected" not in response.content.decode()
    admin_client.post(CHANGELIST, {"action": "delete_selected", "_selected_action": [recorded.pk]})
    assert OrphanEvent.objects.filter(pk=recorded.pk).exists()


@pytest.mark.django_db
def test_rows_do_not_link_to_the_refused_change_view(admin_client):
    recorded = event()

    page = admin_client.get(CHANGELIST).content.decode()

    assert reverse("admin:celery_orphans_orphanevent_change", args=[recorded.pk]) not in page


@pytest.mark.django_db
def test_task_id_links_to_its_task_result_which_the_link_finds(admin_client):
    TaskResult.objects.create(task_id="abc-123", task_name="demoapp.summarize", status="RETRY")
    event("abc-123")
    results = reverse("admin:django_celery_results_taskresult_changelist")
    link = f"{results}?{urlencode({'task_id': 'abc-123'})}"

    page = admin_client.get(CHANGELIST).content.decode()
    assert f'href="{link}"' in page

    followed = admin_client.get(link)
    assert followed.status_code == 200
    assert list(followed.context["cl"].result_list.values_list("task_id", flat=True)) == ["abc-123"]


@pytest.mark.django_db
def test_task_id_without_a_task_result_is_plain_text(admin_client):
    recorded = event()

    page = admin_client.get(CHANGELIST).content.decode()

    assert recorded.task_id in page
    assert "?" + urlencode({"task_id": recorded.task_id}) not in page


@pytest.mark.django_db
def test_task_id_in_the_link_is_escaped(admin_client):
    odd = 'a&b"<c>'
    TaskResult.objects.create(task_id=odd, status="FAILURE")
    event(odd)

    page = admin_client.get(CHANGELIST).content.decode()

    assert urlencode({"task_id": odd}).replace("&", "&amp;") in page
    assert odd not in page


@pytest.mark.django_db
def test_detail_is_shown_with_the_reason(admin_client):
    event(reason="not_recoverable", detail="demoapp.scan is not marked @recoverable")

    page = admin_client.get(CHANGELIST).content.decode()

    assert 'title="demoapp.scan is not marked @recoverable"' in page


def _changelist_queries(client) -> int:
    with CaptureQueriesContext(connection) as queries:
        assert client.get(CHANGELIST).status_code == 200
    return len(queries)


@pytest.mark.django_db
def test_changelist_does_not_query_per_row(admin_client):
    for i in range(2):
        TaskResult.objects.create(task_id=f"few-{i}", status="RETRY")
        event(f"few-{i}")
    few = _changelist_queries(admin_client)
    for i in range(20):
        TaskResult.objects.create(task_id=f"many-{i}", status="RETRY")
        event(f"many-{i}")

    assert _changelist_queries(admin_client) == few
