"""The JSON endpoints: status for dashboards and the sweep lever; guarded, CSRF-protected, rate-limited."""

from __future__ import annotations

import json

import pytest
from django.conf import settings as django_settings
from django.contrib.auth.models import Permission
from django.middleware.csrf import get_token
from django.test import Client, RequestFactory
from django.urls import reverse
from django_celery_results.models import TaskResult
from kombu.exceptions import OperationalError

from celery_orphans import sweep, views
from celery_orphans.models import OrphanEvent, Trigger
from celery_orphans.sweep import runner
from celery_orphans.verdicts import Verdict
from celery_orphans.worker.heartbeat import Heartbeat
from tests import factories
from tests.test_admin import event, sweep_lock_held_elsewhere

STATUS = reverse("celery_orphans:status")
SWEEP = reverse("celery_orphans:sweep")
UNREACHABLE_REDIS = "redis://127.0.0.1:1/0"

pytestmark = pytest.mark.usefixtures("redis_client")


def user(django_user_model, name: str = "ops", *, allowed: bool = True):
    made = django_user_model.objects.create_user(name, password="pw")
    if allowed:
        made.user_permissions.set(Permission.objects.filter(codename="recover_orphans"))
    return made


@pytest.fixture
def ops(client, django_user_model) -> Client:
    client.force_login(user(django_user_model))
    return client


def post(client: Client, body: object = None, **headers: str):
    data = "" if body is None else json.dumps(body)
    return client.post(SWEEP, data, content_type="application/json", headers=headers)


def status_of(task_id: str) -> str:
    return TaskResult.objects.get(task_id=task_id).status


@pytest.mark.django_db
@pytest.mark.parametrize("url", [STATUS, SWEEP])
def test_anonymous_requests_get_401_json(client, url):
    response = client.get(url) if url == STATUS else post(client, {})

    assert response.status_code == 401
    assert response.json() == {"error": "authentication required"}


@pytest.mark.django_db
@pytest.mark.parametrize("url", [STATUS, SWEEP])
def test_users_without_the_permission_get_403_json(client, django_user_model, url):
    client.force_login(user(django_user_model, allowed=False))
    orphan = factories.orphan()

    response = client.get(url) if url == STATUS else post(client, {"task_ids": [orphan]})

    assert response.status_code == 403
    assert "celery_orphans.recover_orphans" in response.json()["error"]
    assert ("celery_orphans.view_status" in response.json()["error"]) is (url == STATUS)
    assert status_of(orphan) == "STARTED"


TOKEN = "probe-" + "x" * 30


@pytest.mark.django_db
def test_the_read_only_permission_reads_status_and_cannot_sweep(client, django_user_model):
    reader = django_user_model.objects.create_user("probe", password="pw")
    reader.user_permissions.set(Permission.objects.filter(codename="view_status"))
    client.force_login(reader)
    orphan = factories.orphan()

    assert client.get(STATUS).status_code == 200
    refused = post(client, {"task_ids": [orphan]})
    assert refused.status_code == 403
    assert refused.json() == {"error": "the permission celery_orphans.recover_orphans is required"}
    assert status_of(orphan) == "STARTED"


@pytest.mark.django_db
def test_the_status_token_reads_status_without_a_user_and_nothing_else(client, settings):
    settings.CELERY_ORPHANS_STATUS_TOKEN = TOKEN
    orphan = factories.orphan()

    read = client.get(STATUS, headers={"Authorization": f"Bearer {TOKEN}"})
    assert read.status_code == 200
    assert {"enabled", "shadow_mode", "last_sweep", "leases"} <= set(read.json())
    assert client.get(STATUS, headers={"Authorization": f"Bearer {TOKEN}x"}).status_code == 401
    assert client.get(STATUS, headers={"Authorization": f"Basic {TOKEN}"}).status_code == 401
    assert post(client, {"task_ids": [orphan]}, Authorization=f"Bearer {TOKEN}").status_code == 401
    assert status_of(orphan) == "STARTED"


@pytest.mark.django_db
def test_without_a_status_token_set_no_bearer_opens_status(client, settings):
    settings.CELERY_ORPHANS_STATUS_TOKEN = None

    assert client.get(STATUS, headers={"Authorization": "Bearer "}).status_code == 401
    assert client.get(STATUS, headers={"Authorization": "Bearer None"}).status_code == 401


@pytest.mark.django_db
def test_each_endpoint_allows_only_its_method(ops):
    assert ops.post(STATUS).status_code == 405
    refused = ops.get(SWEEP)
    assert refused.status_code == 405
    assert refused["Allow"] == "POST"


@pytest.mark.django_db(transaction=True)
def test_status_counts_what_the_last_sweep_found_by_verdict(ops, settings):
    settings.CELERY_ORPHANS_LEASE_SECONDS = 60
    Heartbeat("beating@test", boot="dead-boot").renew()  # its boot beats, so its task is alive
    factories.orphan(worker="beating@test")
    factories.orphan()
    factories.orphan("demoapp.scan", ("db",))
    factories.orphan(started_ago=0.5)
    settings.CELERY_ORPHANS_SHADOW_MODE = True  # the sweep decides and records, and changes nothing
    sweep.run(sweep.Options(trigger=Trigger.BEAT))
    event(task_id="latest", triggered_by="alice", trigger="admin")

    response = ops.get(STATUS)

    assert response.status_code == 200
    body = response.json()
    zero = {verdict.value: 0 for verdict in Verdict}
    assert body["in_flight"] == {
        **zero,
        "total": 4,
        "alive": 1,
        "in_grace": 1,
        "will_recover": 1,
        "not_recoverable": 1,
    }
    assert body["orphans"] == {**zero, "total": 2, "will_recover": 1, "not_recoverable": 1}
    assert body["leases"] == 1
    assert body["last_sweep"]["trigger"] == "beat" and 0 <= body["last_sweep"]["age_seconds"] < 60
    assert body["last_action"]["task_id"] == "latest"
    assert body["last_action"]["triggered_by"] == "alice"
    assert body["enabled"] is True
    assert response["Cache-Control"].startswith("max-age=0")


@pytest.mark.django_db(transaction=True)
def test_status_counts_each_kind_of_task_a_sweep_could_only_report_apart(ops):
    factories.orphan(started_ago=-3600, entry=False)  # its start is an hour ahead: unreadable
    factories.orphan("demoapp.no_such_task", entry=False)  # not registered in this Celery app
    factories.orphan(worker="", entry=False)  # no record names its worker
    sweep.run(sweep.Options(trigger=Trigger.BEAT))

    body = ops.get(STATUS).json()

    zero = {verdict.value: 0 for verdict in Verdict}
    assert body["in_flight"] == {**zero, "total": 3, "unreadable": 1, "unknown_task": 1, "no_worker": 1}
    assert body["last_sweep"]["summary"].startswith(
        "recovered 0 orphaned tasks, marked 0 terminal, forgotten 0 finished, 0 alive or in grace, "
        "1 unreadable, 1 of a task not registered here, 1 without a worker ("
    )


@pytest.mark.django_db
def test_status_before_any_sweep_says_so_and_asks_no_worker(ops, redis_client, monkeypatch):
    def no_sweep(*args: object) -> None:
        raise AssertionError("the status page ran a sweep")

    monkeypatch.setattr(runner, "_judge", no_sweep)

    body = ops.get(STATUS).json()

    assert (body["last_sweep"], body["in_flight"], body["orphans"]) == (None, None, None)


@pytest.mark.django_db
def test_status_is_503_when_redis_cannot_be_reached(ops, settings):
    settings.CELERY_ORPHANS_REDIS_URL = UNREACHABLE_REDIS

    response = ops.get(STATUS)

    assert response.status_code == 503
    assert "Redis" in response.json()["error"]


@pytest.mark.django_db
def test_the_sweep_post_is_refused_without_a_csrf_token(django_user_model):
    strict = Client(enforce_csrf_checks=True)
    strict.force_login(user(django_user_model))
    orphan = factories.orphan()

    refused = post(strict, {"task_ids": [orphan]})

    assert refused.status_code == 403
    assert status_of(orphan) == "STARTED"
    assert not OrphanEvent.objects.exists()

    request = RequestFactory().get("/")
    token = get_token(request)
    strict.cookies[django_settings.CSRF_COOKIE_NAME] = request.META["CSRF_COOKIE"]
    accepted = post(strict, {"task_ids": [orphan]}, **{"X-CSRFToken": token})

    assert accepted.status_code == 200
    assert status_of(orphan) == "RETRY"


@pytest.mark.django_db
def test_posting_task_ids_recovers_them_and_audits_the_user(ops, redis_client):
    orphan = factories.orphan()

    response = post(ops, {"task_ids": [orphan]})

    assert response.status_code == 200
    [result] = response.json()["results"]
    assert result["status"] == "recovered"
    assert (result["action"], result["done"], result["attempt"]) == ("recover", True, 1)
    assert "attempt 1" in result["message"]
    assert status_of(orphan) == "RETRY"
    assert redis_client.llen("celery") == 1  # the message is on its queue again
    recorded = OrphanEvent.objects.get(task_id=orphan)
    assert (recorded.action, recorded.trigger, recorded.triggered_by) == ("recovered", "api", "ops")


@pytest.mark.django_db
def test_posting_task_ids_never_marks_a_non_recoverable_task_terminal(ops):
    scan = factories.orphan("demoapp.scan", ("db",))

    response = post(ops, {"task_ids": [scan, "no-such-task"]})

    results = {r["task_id"]: r for r in response.json()["results"]}
    assert (results[scan]["status"], results[scan]["reason"]) == ("refused", "not_recoverable")
    assert "not marked @recoverable" in results[scan]["message"]
    assert results["no-such-task"]["status"] == "not_found"
    assert status_of(scan) == "STARTED"
    # Nothing was done; each refusal is on record, with who asked.
    refused = OrphanEvent.objects.values_list("task_id", "action", "reason", "triggered_by")
    assert sorted(refused) == sorted(
        [(scan, "refused", "refused", "ops"), ("no-such-task", "refused", "not_found", "ops")]
    )


@pytest.mark.django_db
@pytest.mark.parametrize("body", [None, {}])
def test_posting_no_task_ids_runs_a_whole_sweep(ops, body):
    summarize, scan = factories.orphan(), factories.orphan("demoapp.scan", ("db",))

    response = post(ops, body)

    assert response.status_code == 200
    outcomes = {o["task_id"]: o for o in response.json()["results"]}
    assert (outcomes[summarize]["action"], outcomes[summarize]["done"]) == ("recover", True)
    assert (outcomes[scan]["action"], outcomes[scan]["done"]) == ("mark_terminal", True)
    assert (outcomes[summarize]["status"], outcomes[scan]["status"]) == ("recovered", "marked_terminal")
    assert (status_of(summarize), status_of(scan)) == ("RETRY", "FAILURE")
    assert set(OrphanEvent.objects.values_list("trigger", "triggered_by")) == {("api", "ops")}


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("body", "complaint"),
    [
        (b"not json", "must be JSON"),
        (b"[1, 2]", "JSON object"),
        (b'{"task_ids": "abc"}', "list"),
        (b'{"task_ids": []}', "non-empty list"),
        (b'{"task_ids": [1]}', "string"),
        (b'{"task_ids": [""]}', "1 to 255"),
        (json.dumps({"task_ids": ["x" * 256]}).encode(), "1 to 255"),
        (json.dumps({"task_ids": [str(i) for i in range(1001)]}).encode(), "at most 1000"),
        (b'{"task_ids": ["a"], "mark_terminal": true}', "unknown fields: mark_terminal"),
    ],
)
def test_a_malformed_body_is_a_400_and_does_nothing(ops, body, complaint):
    orphan = factories.orphan()

    response = ops.post(SWEEP, body, content_type="application/json")

    assert response.status_code == 400
    assert complaint in response.json()["error"]
    assert status_of(orphan) == "STARTED"


@pytest.mark.django_db
def test_posts_beyond_the_rate_limit_get_429_with_retry_after(ops, client, django_user_model):
    for _ in range(views.RATE_LIMIT.hits):
        assert post(ops, {"task_ids": ["no-such-task"]}).status_code == 200

    limited = post(ops, {"task_ids": ["no-such-task"]})

    assert limited.status_code == 429
    assert 1 <= int(limited["Retry-After"]) <= views.RATE_LIMIT.seconds
    assert limited.json()["retry_after"] == int(limited["Retry-After"])
    other = Client()
    other.force_login(user(django_user_model, "other"))
    assert post(other, {"task_ids": ["no-such-task"]}).status_code == 200  # counted per user


@pytest.mark.django_db
def test_a_held_sweep_lock_is_a_409(ops):
    orphan = factories.orphan()

    with sweep_lock_held_elsewhere():
        response = post(ops, {"task_ids": [orphan]})

    assert response.status_code == 409
    assert "lock" in response.json()["error"]
    assert status_of(orphan) == "STARTED"


@pytest.mark.django_db
def test_nothing_is_changed_while_recovery_is_switched_off(ops, settings):
    settings.CELERY_ORPHANS_ENABLED = False
    orphan = factories.orphan()

    for body in ({"task_ids": [orphan]}, {}):
        response = post(ops, body)
        assert response.status_code == 409
        assert "CELERY_ORPHANS_ENABLED is off" in response.json()["error"]
    assert status_of(orphan) == "STARTED"


@pytest.mark.django_db
def test_the_sweep_post_is_503_when_redis_cannot_be_reached(ops, settings):
    orphan = factories.orphan()
    settings.CELERY_ORPHANS_REDIS_URL = UNREACHABLE_REDIS

    response = post(ops, {"task_ids": [orphan]})

    assert response.status_code == 503
    assert status_of(orphan) == "STARTED"


@pytest.mark.django_db
def test_in_shadow_mode_a_recovery_is_only_recorded(ops, settings):
    settings.CELERY_ORPHANS_SHADOW_MODE = True
    orphan = factories.orphan()

    [result] = post(ops, {"task_ids": [orphan]}).json()["results"]

    assert (result["status"], result["done"]) == ("would_recover", True)
    assert status_of(orphan) == "STARTED"
    recorded = OrphanEvent.objects.get(task_id=orphan)
    assert (recorded.action, recorded.trigger, recorded.triggered_by) == ("would_recover", "api", "ops")


@pytest.mark.django_db
def test_a_recovery_that_fails_part_way_is_a_503_naming_the_task(ops, monkeypatch):
    def broker_down(*args: object, **kwargs: object) -> None:
        raise OperationalError("the broker is down")

    monkeypatch.setattr("celery_orphans.recovery.broker.publish", broker_down)
    orphan = factories.orphan()

    response = post(ops, {"task_ids": [orphan]})

    assert response.status_code == 503
    [result] = response.json()["results"]
    assert result["status"] == "failed"
    assert "OperationalError" in result["message"]
    assert "the broker is down" not in response.content.decode()  # the library's text stays in the log
    assert status_of(orphan) == "STARTED"
    assert list(OrphanEvent.objects.values_list("action", "triggered_by")) == [("failed", "ops")]


def test_status_reports_the_last_sweep_that_was_not_a_dry_run(ops, redis_client):
    factories.orphan()
    sweep.run(sweep.Options(trigger=Trigger.COMMAND, grace_seconds=0))

    last = ops.get(STATUS).json()["last_sweep"]

    assert last["trigger"] == "command"
    assert last["ok"] is True
    assert last["summary"].startswith("recovered 1 orphaned tasks")
