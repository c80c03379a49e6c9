"""The operators' service: three doors (the command, the HTTP API, the admin), one error mapping."""

from __future__ import annotations

import getpass
import io
import os
import socket

import pytest
import redis
from django.contrib.auth.models import Permission
from django.core.exceptions import ImproperlyConfigured
from django.core.management import CommandError, call_command
from django.db import OperationalError
from django.urls import reverse
from django_celery_results.models import TaskResult
from kombu.exceptions import OperationalError as BrokerError

from celery_orphans import operations
from celery_orphans.answers import Status
from celery_orphans.models import AuditAction, OrphanEvent, Trigger
from celery_orphans.operations import Problem, Refused
from tests import factories

SECRET = "hunter2"
IN_FLIGHT = reverse("admin:celery_orphans_inflight")
SWEEP = reverse("celery_orphans:sweep")
STATUS = reverse("celery_orphans:status")

# A fault of each service a sweep needs, as its library words it (a URL with a password in it, for
# the worst case), and the sentence every door shows for it.
FAULTS = [
    (redis.ConnectionError(f"Error connecting to redis://:{SECRET}@cache:6379/0"), "cannot reach Redis"),
    (OperationalError(f"connection to postgres://ops:{SECRET}@db/x failed"), "cannot reach the database"),
    (BrokerError(f"amqp://guest:{SECRET}@mq:5672// is down"), "cannot reach the broker"),
    (ImproperlyConfigured("CELERY_ORPHANS_REDIS_URL is not a URL"), "CELERY_ORPHANS_REDIS_URL is not a URL"),
]
IDS = ["redis", "database", "broker", "configuration"]

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("redis_client")]


@pytest.fixture
def fault(request, monkeypatch) -> str:
    """Every sweep fails with the fault; returns the sentence the doors must show."""
    exc, said = request.param

    def failing(*args: object, **kwargs: object) -> None:
        raise exc

    monkeypatch.setattr("celery_orphans.sweep.runner._judge", failing)
    return said


@pytest.mark.parametrize("fault", FAULTS, ids=IDS, indirect=True)
def test_the_command_says_what_failed_without_the_password(fault):
    with pytest.raises(CommandError) as raised:
        call_command("reconcile_orphan_tasks", "--dry-run", stdout=io.StringIO())

    assert fault in str(raised.value)
    assert SECRET not in str(raised.value)


@pytest.mark.parametrize("fault", FAULTS, ids=IDS, indirect=True)
def test_the_api_answers_503_with_the_cause_never_a_500(fault, client, django_user_model):
    user = django_user_model.objects.create_user("ops", password="pw")
    user.user_permissions.set(Permission.objects.filter(codename="recover_orphans"))
    client.force_login(user)
    orphan = factories.orphan()

    response = client.post(SWEEP, {"task_ids": [orphan]}, content_type="application/json")

    assert response.status_code == 503
    assert fault in response.json()["error"]
    assert SECRET not in response.content.decode()
    for library_text in ("Error connecting", "failed", "is down"):
        assert library_text not in response.content.decode()
    assert TaskResult.objects.get(task_id=orphan).status == "STARTED"


@pytest.mark.parametrize("fault", FAULTS, ids=IDS, indirect=True)
def test_the_admin_shows_the_cause_on_the_page_never_a_500(fault, admin_client):
    orphan = factories.orphan()

    page = admin_client.get(IN_FLIGHT)
    acted = admin_client.post(IN_FLIGHT, {"action": "recover", "task_id": [orphan]}, follow=True)

    assert page.status_code == acted.status_code == 200
    assert f"Could not judge the running tasks: {fault}" in page.content.decode()
    [said] = [str(m) for m in acted.context["messages"]]
    assert said.startswith(f"Recover now: nothing was done: {fault}")
    assert SECRET not in page.content.decode() + said


def test_a_database_fault_in_the_status_endpoint_is_a_503(admin_client, monkeypatch):
    def failing(*args: object, **kwargs: object) -> None:
        raise OperationalError(f"server closed the connection (password={SECRET})")

    monkeypatch.setattr("django.db.models.query.QuerySet.first", failing)

    response = admin_client.get(STATUS)

    assert response.status_code == 503
    assert response.json()["error"] == "cannot reach the database (OperationalError; see the server's log)"
    assert "server closed the connection" not in response.content.decode()
    assert response.json()["problem"] == "unavailable"
    assert SECRET not in response.content.decode()


@pytest.mark.parametrize(
    "text",
    [
        f"redis://:{SECRET}@host:6379/0",
        f"redis://user:{SECRET}@host:6379/0",
        f"sentinel://:{SECRET}@h:26379;sentinel://:{SECRET}@h2:26379",
        f"FATAL: password={SECRET} rejected",
    ],
)
def test_a_cause_never_shows_a_password(text):
    shown = operations.cause(ValueError(text))

    assert shown.startswith("ValueError: ")
    assert SECRET not in shown


def test_a_real_run_is_refused_while_recovery_is_switched_off(settings):
    settings.CELERY_ORPHANS_ENABLED = False
    orphan = factories.orphan()

    with pytest.raises(Refused) as raised:
        operations.sweep(Trigger.COMMAND)

    assert raised.value.problem is Problem.SWITCHED_OFF
    assert operations.sweep(Trigger.COMMAND, dry_run=True).dry_run  # a dry run changes nothing
    assert TaskResult.objects.get(task_id=orphan).status == "STARTED"


def test_every_door_gets_one_result_shape_and_status_per_task():
    summarize, scan = factories.orphan(), factories.orphan("demoapp.scan", ("db",))

    would = operations.sweep(Trigger.COMMAND, dry_run=True, grace_seconds=0)
    chosen = operations.act_on([scan, "no-such-task"], mark_terminal=False, trigger=Trigger.API, user="ops")
    swept = operations.sweep(Trigger.API, "ops", grace_seconds=0)

    statuses = {
        (name, r.task_id): r.status
        for name, answer in (("would", would), ("chosen", chosen), ("swept", swept))
        for r in answer.results
    }
    assert statuses == {
        ("would", summarize): Status.WOULD_RECOVER,
        ("would", scan): Status.WOULD_MARK_TERMINAL,
        ("chosen", scan): Status.REFUSED,
        ("chosen", "no-such-task"): Status.NOT_FOUND,
        ("swept", summarize): Status.RECOVERED,
        ("swept", scan): Status.MARKED_TERMINAL,
    }
    shapes = {frozenset(r.as_json()) for a in (would, chosen, swept) for r in a.results}
    assert len(shapes) == 1


# --- what the audit log records besides actions --------------------------------------------------------


def events(action: str) -> list[tuple[str, str, str, str]]:
    rows = OrphanEvent.objects.filter(action=action).order_by("id")
    return [(e.reason, e.task_id, e.trigger, e.triggered_by) for e in rows]


def test_a_refused_sweep_is_audited_with_the_person_who_asked(settings):
    settings.CELERY_ORPHANS_ENABLED = False

    with pytest.raises(Refused):
        operations.sweep(Trigger.API, "alice")

    assert events(AuditAction.REFUSED) == [("switched_off", "", "api", "alice")]


def test_a_sweep_that_finds_nothing_to_do_is_audited_with_the_person_who_asked():
    operations.sweep(Trigger.ADMIN, "alice")

    [event] = OrphanEvent.objects.filter(action=AuditAction.NOTHING_TO_DO)
    assert (event.triggered_by, event.trigger) == ("alice", "admin")
    assert "recovered 0 orphaned tasks" in event.detail


def test_a_command_that_finds_nothing_to_do_is_audited_with_the_user_and_host_that_ran_it():
    call_command("reconcile_orphan_tasks", stdout=io.StringIO())

    [event] = OrphanEvent.objects.filter(action=AuditAction.NOTHING_TO_DO)
    assert (event.triggered_by, event.trigger) == (f"{getpass.getuser()}@{socket.gethostname()}", "command")


def test_the_commands_user_is_named_even_where_the_system_knows_no_login_name(monkeypatch):
    def unknown() -> str:
        raise KeyError("getpwuid(): uid not found: 12345")

    monkeypatch.setattr(getpass, "getuser", unknown)

    assert operations.shell_user() == f"uid {os.getuid()}@{socket.gethostname()}"


def test_each_chosen_task_that_is_refused_is_audited():
    operations.act_on(["no-such-task"], mark_terminal=True, trigger=Trigger.API, user="alice")

    assert events(AuditAction.REFUSED) == [("not_found", "no-such-task", "api", "alice")]


def test_an_action_that_fails_is_audited_without_the_library_text(monkeypatch):
    orphan = factories.orphan()

    def failing(*args: object, **kwargs: object) -> None:
        raise BrokerError(f"amqp://guest:{SECRET}@mq:5672// is down")

    monkeypatch.setattr("celery_orphans.recovery.broker.publish", failing)
    answer = operations.act_on([orphan], mark_terminal=False, trigger=Trigger.ADMIN, user="alice")

    assert answer.results[0].failed
    [event] = OrphanEvent.objects.filter(action=AuditAction.FAILED)
    assert (event.task_id, event.triggered_by) == (orphan, "alice")
    assert "OperationalError" in event.detail and "is down" not in event.detail


def test_shadow_mode_records_the_operator_who_asked_even_after_a_beat_sweep(settings):
    settings.CELERY_ORPHANS_SHADOW_MODE = True
    orphan = factories.orphan()

    operations.sweep(Trigger.BEAT, grace_seconds=0)
    operations.sweep(Trigger.ADMIN, "alice", grace_seconds=0)
    operations.sweep(Trigger.ADMIN, "alice", grace_seconds=0)

    assert events(AuditAction.WOULD_RECOVER) == [
        ("recoverable", orphan, "beat", ""),
        ("recoverable", orphan, "admin", "alice"),
    ]
