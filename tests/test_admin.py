"""The admin: the audit log (listed, searchable, linked to task results, never changeable) and the
in-flight view (every running task's verdict, and the recover / mark terminal actions)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from django.contrib.auth.models import Permission
from django.db import connection, connections
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils.http import urlencode
from django_celery_results.models import TaskResult

from celery_orphans.models import OrphanEvent
from celery_orphans.sweep.lock import ADVISORY_LOCK_ID
from celery_orphans.worker.heartbeat import Heartbeat
from tests import factories
from tests.helpers import lapse, wait_for

CHANGELIST = reverse("admin:celery_orphans_orphanevent_changelist")
IN_FLIGHT = reverse("admin:celery_orphans_inflight")
UNREACHABLE_REDIS = "redis://127.0.0.1:1/0"


def event(task_id: str | None = None, **fields: object) -> OrphanEvent:
    values: dict[str, object] = {
        "task_id": task_id or str(uuid.uuid4()),
        "task_name": "demoapp.summarize",
        "worker": "w1@test",
        "action": "recovered",
        "reason": "recoverable",
        "evidence": "lease_lapsed",
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
        "worker_<wbr>answered_<wbr>without_<wbr>task",  # free to wrap after an underscore
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


# The in-flight view.


@contextmanager
def sweep_lock_held_elsewhere() -> Iterator[None]:
    """Another session holds the sweep's advisory lock for the block, as a running sweep would."""
    if connection.vendor != "postgresql":
        pytest.skip("the sweep lock is a PostgreSQL advisory lock here")
    other = connections.create_connection("default")
    try:
        with other.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_lock(%s)", [ADVISORY_LOCK_ID])
        yield
    finally:
        other.close()  # ending the session lets go of its lock


def verdicts(response) -> dict[str, str]:
    assert response.status_code == 200
    return {row.outcome.decision.task_id: row.label for row in response.context["rows"]}


def act(client, action: str, *task_ids: str) -> list[str]:
    """Run an action from the in-flight page; the messages it left, in order."""
    response = client.post(IN_FLIGHT, {"action": action, "task_id": list(task_ids)}, follow=True)
    assert response.status_code == 200
    assert response.redirect_chain == [(IN_FLIGHT, 302)]
    return [str(m) for m in response.context["messages"]]


def status_of(task_id: str) -> str:
    return TaskResult.objects.get(task_id=task_id).status


@pytest.mark.django_db
def test_anonymous_user_is_sent_to_log_in(client):
    response = client.get(IN_FLIGHT)

    assert response.status_code == 302
    assert response["Location"] == f"{reverse('admin:login')}?next={IN_FLIGHT}"


@pytest.mark.django_db
def test_staff_without_view_or_recover_permission_is_refused(client, django_user_model):
    assert staff_client(client, django_user_model).get(IN_FLIGHT).status_code == 403


@pytest.mark.django_db
def test_every_verdict_is_shown_with_its_worker_evidence_and_last_heartbeat(
    admin_client, settings, redis_client
):
    settings.CELERY_ORPHANS_LEASE_SECONDS = 60
    Heartbeat("beating@test", boot="dead-boot").renew()
    alive = factories.orphan(worker="beating@test")
    # A boot that beat a moment ago and then lost its lease: killed just now.
    Heartbeat("killed@test", boot="dead-boot").renew()
    lapse(redis_client, "killed@test", "dead-boot")
    recover = factories.orphan(worker="killed@test")
    scan = factories.orphan("demoapp.scan", ("db",))
    pickled = factories.orphan(content_type="application/x-python-serialize")
    young = factories.orphan(started_ago=0.5)
    unknown = factories.orphan("nowhere.task")

    response = admin_client.get(IN_FLIGHT)

    assert verdicts(response) == {
        alive: "alive",
        recover: "orphan (will be recovered)",
        scan: "not recoverable",
        pickled: "orphan (will be marked terminal: "
        "a application/x-python-serialize message is never sent again)",
        young: "in grace",
        unknown: "unknown task: task 'nowhere.task' is not registered in this Celery app",
    }
    rows = {row.outcome.decision.task_id: row for row in response.context["rows"]}
    assert rows[alive].outcome.decision.evidence.value == "boot_alive"
    assert rows[recover].outcome.decision.evidence.value == "lease_lapsed"
    assert rows[recover].outcome.worker == "killed@test"
    assert rows[recover].heartbeat_age is not None and 0 <= rows[recover].heartbeat_age < 10
    assert rows[scan].heartbeat_age is None
    assert rows[scan].heartbeat_age_text == "no heartbeat on record"
    page = response.content.decode()
    for text in ("killed@test", "lease_lapsed", "Recover now", "Mark terminal", "not recoverable"):
        assert text in page
    assert f'name="task_id" value="{recover}"' in page


@pytest.mark.django_db
@pytest.mark.usefixtures("redis_client")
def test_staff_with_view_permission_sees_verdicts_but_no_actions(client, django_user_model):
    orphan = factories.orphan()
    staff = staff_client(client, django_user_model, "view_orphanevent")

    response = staff.get(IN_FLIGHT)

    assert verdicts(response) == {orphan: "orphan (will be recovered)"}
    page = response.content.decode()
    assert "Recover now" not in page
    assert 'name="task_id"' not in page
    for action in ("recover", "mark_terminal"):
        assert staff.post(IN_FLIGHT, {"action": action, "task_id": [orphan]}).status_code == 403
    assert status_of(orphan) == "STARTED"
    assert not OrphanEvent.objects.exists()


@pytest.mark.django_db
@pytest.mark.usefixtures("redis_client")
def test_the_recover_permission_alone_shows_the_list_and_the_actions(client, django_user_model):
    orphan = factories.orphan()

    response = staff_client(client, django_user_model, "recover_orphans").get(IN_FLIGHT)

    assert verdicts(response) == {orphan: "orphan (will be recovered)"}
    assert "Recover now" in response.content.decode()


@pytest.mark.django_db
def test_recover_now_sends_an_orphan_again_and_audits_the_user(client, django_user_model, redis_client):
    orphan = factories.orphan()
    staff = staff_client(client, django_user_model, "recover_orphans")

    said = act(staff, "recover", orphan)

    assert said == [f"Recovered demoapp.summarize[{orphan}] (attempt 1): sent again."]
    assert status_of(orphan) == "RETRY"
    assert redis_client.llen("celery") == 1
    recorded = OrphanEvent.objects.get(task_id=orphan)
    assert (recorded.action, recorded.trigger, recorded.triggered_by) == ("recovered", "admin", "staff")


@pytest.mark.django_db
@pytest.mark.usefixtures("redis_client")
def test_recover_now_refuses_a_task_that_is_not_recoverable_and_leaves_it(admin_client):
    scan = factories.orphan("demoapp.scan", ("db",))

    [said] = act(admin_client, "recover", scan)

    assert said.startswith(
        f"Refused to recover demoapp.scan[{scan}]: demoapp.scan is not marked @recoverable"
    )
    assert "left as it is" in said
    assert status_of(scan) == "STARTED"
    assert list(OrphanEvent.objects.values_list("action", flat=True)) == ["refused"]  # nothing done


@pytest.mark.django_db
@pytest.mark.usefixtures("redis_client")
def test_mark_terminal_closes_orphans_and_audits_the_user(client, django_user_model):
    scan, summarize = factories.orphan("demoapp.scan", ("db",)), factories.orphan()
    staff = staff_client(client, django_user_model, "recover_orphans")

    said = act(staff, "mark_terminal", scan, summarize)

    assert sorted(said) == sorted(
        f"Marked {name}[{task_id}] terminal: its result is now FAILURE."
        for name, task_id in (("demoapp.scan", scan), ("demoapp.summarize", summarize))
    )
    assert (status_of(scan), status_of(summarize)) == ("FAILURE", "FAILURE")
    events = OrphanEvent.objects.values_list("action", "reason", "trigger", "triggered_by")
    assert list(events) == [("marked_terminal", "by_operator", "admin", "staff")] * 2


@pytest.mark.django_db
@pytest.mark.usefixtures("redis_client")
def test_an_action_on_a_task_that_is_not_running_says_so(admin_client):
    assert act(admin_client, "recover", "gone") == [
        "gone: no running task has this id (it ended or never ran)."
    ]


@pytest.mark.django_db
@pytest.mark.usefixtures("redis_client")
def test_an_action_without_a_selection_does_nothing(admin_client):
    orphan = factories.orphan()

    assert act(admin_client, "recover") == ["Select the tasks to act on; nothing was done."]
    assert act(admin_client, "explode", orphan) == ["Choose an action."]
    assert status_of(orphan) == "STARTED"


@pytest.mark.django_db
@pytest.mark.usefixtures("redis_client")
def test_a_held_sweep_lock_is_an_error_message_not_a_500(admin_client):
    orphan = factories.orphan()

    with sweep_lock_held_elsewhere():
        said = act(admin_client, "recover", orphan)

    assert said == ["Recover now: nothing was done: another reconcile sweep holds the lock"]
    assert status_of(orphan) == "STARTED"


@pytest.mark.django_db
@pytest.mark.usefixtures("redis_client")
def test_unreachable_redis_is_an_error_message_not_a_500(admin_client, settings):
    orphan = factories.orphan()
    settings.CELERY_ORPHANS_REDIS_URL = UNREACHABLE_REDIS

    page = admin_client.get(IN_FLIGHT)
    [said] = act(admin_client, "mark_terminal", orphan)

    assert page.status_code == 200
    assert "Could not judge the running tasks: cannot reach Redis" in page.content.decode()
    assert "No task is running" not in page.content.decode()
    assert "Not known: the running tasks could not be judged" in page.content.decode()
    assert said.startswith("Mark terminal: nothing was done: cannot reach Redis")
    assert status_of(orphan) == "STARTED"


@pytest.mark.django_db
@pytest.mark.usefixtures("redis_client")
def test_actions_change_nothing_while_recovery_is_switched_off(admin_client, settings):
    settings.CELERY_ORPHANS_ENABLED = False
    orphan = factories.orphan()

    assert act(admin_client, "recover", orphan) == [
        "Recover now: nothing was done: CELERY_ORPHANS_ENABLED is off: nothing was changed"
    ]
    assert status_of(orphan) == "STARTED"


@pytest.mark.django_db
def test_the_audit_log_links_to_the_in_flight_view(admin_client):
    assert f'href="{IN_FLIGHT}"' in admin_client.get(CHANGELIST).content.decode()


@pytest.mark.worker
def test_both_actions_refuse_a_task_its_worker_is_still_running(workers, client, django_user_model, settings):
    from demoapp.tasks import summarize

    settings.CELERY_ORPHANS_GRACE_SECONDS = 0  # judged at once, like the actions judge it

    workers.start("busy@test")
    running = summarize.delay([1, 2], seconds=60).id
    wait_for(
        lambda: TaskResult.objects.filter(task_id=running, status="STARTED").exists(),
        20,
        f"{running} to start",
    )
    staff = staff_client(client, django_user_model, "recover_orphans")

    assert verdicts(staff.get(IN_FLIGHT)) == {running: "alive"}
    for action, verb in (("recover", "recover"), ("mark_terminal", "mark terminal")):
        assert act(staff, action, running) == [
            f"Refused to {verb} demoapp.summarize[{running}]: worker busy@test is alive and still has it "
            "(boot alive)."
        ]
    assert status_of(running) == "STARTED"
    assert set(OrphanEvent.objects.values_list("action", flat=True)) == {"refused"}  # nothing done


@pytest.mark.django_db
def test_the_evidence_says_what_it_means_where_the_operator_reads_it(admin_client):
    event(evidence="lease_lapsed")
    event(evidence="process_exited")

    page = admin_client.get(CHANGELIST).content.decode()

    assert "Redis&#x27;s expiry noticed, as no worker on its machine saw its process exit" in page
    assert "(the same death as lease_lapsed, seen sooner)" in page
    assert "lease_<wbr>lapsed" in page and "process_<wbr>exited" in page  # free to wrap at 1,400 px


def test_every_evidence_of_a_decision_has_a_meaning():
    from celery_orphans.decision import Evidence
    from celery_orphans.verdicts import meaning

    assert [e for e in Evidence if e is not Evidence.NONE and not meaning(e.value)] == []
    assert meaning("") == meaning("from_a_later_version") == ""


@pytest.mark.django_db
@pytest.mark.usefixtures("redis_client")
@pytest.mark.parametrize(
    ("enabled", "shadow", "said"),
    [
        (False, False, ["celery-orphans is switched off (CELERY_ORPHANS_ENABLED)"]),
        (True, True, ["Shadow mode (CELERY_ORPHANS_SHADOW_MODE)"]),
        (False, True, ["celery-orphans is switched off", "Shadow mode"]),
        (True, False, []),
    ],
)
def test_both_pages_say_when_the_app_is_switched_off_or_in_shadow_mode(
    admin_client, settings, enabled, shadow, said
):
    settings.CELERY_ORPHANS_ENABLED = enabled
    settings.CELERY_ORPHANS_SHADOW_MODE = shadow

    for url in (CHANGELIST, IN_FLIGHT):
        page = admin_client.get(url).content.decode()
        notices = page.split('class="messagelist celery-orphans-notices"', 1)[1:]
        assert all(text in notices[0] for text in said) if said else notices == [], url
