"""What a forged record can make the sweep do, and where a Redis password must never show up.

A ledger entry or a result row is data anyone with write access to Redis or the results table can forge.
The sweep must never turn one into a run of a task that is not ``@recoverable``, never send a pickled
message, and never print the password of the Redis it uses: not in logs, audit rows or admin pages.
"""

from __future__ import annotations

import json
import logging
import pickle
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.urls import reverse
from django_celery_results.models import TaskResult

from celery_orphans import sweep
from celery_orphans.decision import Action, Reason
from celery_orphans.exceptions import LedgerUnavailable
from celery_orphans.ledger import Ledger
from celery_orphans.models import OrphanEvent
from celery_orphans.recovery import broker
from celery_orphans.store import Keys, client
from tests import factories
from tests.helpers import published, sweep_now, wait_for
from tests.services import RedisServer


def decisions(report: sweep.Report) -> dict[str, tuple[Action, Reason]]:
    return {o.decision.task_id: (o.decision.action, o.decision.reason) for o in report.outcomes}


def rewrite_entry(task_id: str, change: Any) -> None:
    """Alter the stored ledger entry of ``task_id`` as a holder of the signing key could: ``change`` edits
    its JSON in place, and the entry is sealed again."""
    keys = Keys.current()
    conn = client()
    data = factories.opened(conn.hget(keys.entry(task_id), "entry"))
    change(data)
    conn.hset(keys.entry(task_id), "entry", factories.sealed(json.dumps(data)))


@pytest.fixture
def quick_sweeps(settings: Any) -> None:
    # The orphans here belong to a node that never answers: do not wait a second for it every sweep.
    settings.CELERY_ORPHANS_INSPECT_TIMEOUT_SECONDS = 0.05


# --- forged records ------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("name", ["demoapp.scan", "celery_orphans.reconcile", "celery.backend_cleanup"])
def test_forged_row_and_entry_naming_a_task_that_is_not_recoverable_are_never_published(
    name: str, redis_client: Any, quick_sweeps: None
) -> None:
    with_entry = factories.orphan(name, ("db-1",))
    entry_only = factories.orphan(name, ("db-2",), row=False)
    row_only = factories.orphan(name, ("db-3",), entry=False)

    found = decisions(sweep_now())

    terminal = (Action.MARK_TERMINAL, Reason.NOT_RECOVERABLE)
    assert found == {with_entry: terminal, entry_only: terminal, row_only: terminal}
    assert published(redis_client) == []
    assert set(TaskResult.objects.values_list("status", flat=True)) == {"FAILURE"}


@pytest.mark.django_db(transaction=True)
def test_forged_entry_naming_a_task_this_app_does_not_know_is_reported_and_never_published(
    redis_client: Any, quick_sweeps: None
) -> None:
    task_id = factories.orphan("somewhere.else.delete_everything", row=False)

    report = sweep_now()

    [outcome] = report.outcomes
    assert (outcome.decision.action, outcome.decision.reason) == (Action.REPORT, Reason.UNKNOWN_TASK)
    assert not outcome.done
    assert published(redis_client) == []
    assert Ledger(client(), Keys.current()).load([task_id])[task_id] is not None  # left for a person


@pytest.mark.django_db(transaction=True)
def test_a_result_row_alone_never_makes_the_sweep_publish_anything(redis_client: Any, quick_sweeps: None):
    # A row holds only a repr of the arguments: sending it again would mean rebuilding a message from it.
    ids = [
        factories.orphan(name, entry=False) for name in ("demoapp.summarize", "demoapp.add", "demoapp.scan")
    ]

    found = decisions(sweep_now())

    assert {found[i][0] for i in ids} == {Action.MARK_TERMINAL}
    assert published(redis_client) == []


def _run_another_task(data: dict[str, Any]) -> None:
    data["delivery"]["headers"]["task"] = "demoapp.scan"


def _run_another_id(data: dict[str, Any]) -> None:
    data["delivery"]["headers"]["id"] = str(uuid.uuid4())


def _protocol_one(data: dict[str, Any]) -> None:
    # Without a task header Celery reads the message as protocol 1: the body names the task.
    data["delivery"]["headers"] = {}
    data["delivery"]["body"] = json.dumps(
        {"task": "demoapp.scan", "id": data["task_id"], "args": ["db-1"], "kwargs": {}}
    )


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "forge",
    [
        pytest.param(_run_another_task, id="headers-name-another-task"),
        pytest.param(_run_another_id, id="headers-name-another-id"),
        pytest.param(_protocol_one, id="protocol-1-body-names-another-task"),
    ],
)
def test_entry_whose_message_would_run_something_else_than_it_names_is_refused(
    forge: Any, redis_client: Any, quick_sweeps: None
) -> None:
    task_id = factories.orphan("demoapp.summarize")
    rewrite_entry(task_id, forge)

    found = decisions(sweep_now())

    # The entry cannot be trusted, so it is reported and nothing is sent.
    assert published(redis_client) == []
    assert found[task_id] == (Action.REPORT, Reason.UNREADABLE)


class _Trap:
    """Unpickling this creates a file: proof that someone unpickled it."""

    path = ""

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (Path(self.path),))


@pytest.mark.django_db(transaction=True)
def test_pickled_message_is_never_unpickled_or_sent_again(redis_client: Any, quick_sweeps: None, tmp_path):
    trap = _Trap()
    trap.path = str(tmp_path / "unpickled")
    task_id = factories.orphan(content_type="application/x-python-serialize")
    body = pickle.dumps(((trap,), {}, {}), protocol=0).decode("latin-1")
    rewrite_entry(task_id, lambda data: data["delivery"].update(body=body))

    found = decisions(sweep_now())

    assert found[task_id] == (Action.MARK_TERMINAL, Reason.UNSAFE_MESSAGE)
    assert published(redis_client) == []
    assert not (tmp_path / "unpickled").exists()
    assert TaskResult.objects.get(task_id=task_id).status == "FAILURE"


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "content_type",
    ["application/x-python-serialize", "Application/X-Python-Serialize", "application/x-pickle", ""],
)
def test_publish_itself_refuses_a_message_that_is_not_plain_data(
    content_type: str, redis_client: Any
) -> None:
    from testproject.celery import app

    delivery = replace(factories.delivery("demoapp.summarize", str(uuid.uuid4())), content_type=content_type)

    with pytest.raises(ValueError, match="refusing to send"):
        broker.publish(app, factories.ledger_entry(delivery), {"attempt": 1})

    assert published(redis_client) == []


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "change",
    [{"task_name": "demoapp.add"}, {"task_id": "another-id"}],
    ids=["another-task", "another-id"],
)
def test_publish_itself_refuses_a_message_that_runs_another_task_than_recovered(
    change: dict[str, str], redis_client: Any
) -> None:
    from testproject.celery import app

    made = factories.ledger_entry(factories.delivery("demoapp.summarize", str(uuid.uuid4())))

    with pytest.raises(ValueError, match="does not run"):
        broker.publish(app, replace(made, **change), {"attempt": 1})

    assert published(redis_client) == []


# --- a Redis password --------------------------------------------------------------------------


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path, password=f"pw-{uuid.uuid4().hex}").start()
    yield server
    server.stop()


def assert_secret_absent(secret: str, **texts: str) -> None:
    leaked = [where for where, text in texts.items() if secret in text]
    assert not leaked, f"the Redis password appears in: {', '.join(leaked)}"


def audit_text() -> str:
    return json.dumps(list(OrphanEvent.objects.values()), default=str)


def admin_pages(admin_client: Any) -> dict[str, str]:
    """Every page of ours an operator opens, as rendered for a superuser."""
    pages = {
        "OrphanEvent changelist": reverse("admin:celery_orphans_orphanevent_changelist"),
        "in-flight admin view": reverse("admin:celery_orphans_inflight"),
        "status endpoint": reverse("celery_orphans:status"),
    }
    rendered = {}
    for name, url in pages.items():
        response = admin_client.get(url)
        assert response.status_code in {200, 503}, (name, response.status_code)
        rendered[name] = response.content.decode()
    return rendered


@pytest.mark.worker
def test_redis_password_is_in_no_log_audit_row_or_admin_page_of_a_recovery(
    workers: Any,
    private_redis: RedisServer,
    settings: Any,
    caplog: Any,
    admin_client: Any,
    celery_app: Any,
) -> None:
    from demoapp.tasks import summarize

    url = private_redis.url()
    settings.CELERY_ORPHANS_REDIS_URL = url
    settings.REDIS_URL = url  # where demoapp records executions
    env = {"REDIS_URL": url, "CELERY_BROKER_URL": str(celery_app.conf.broker_url)}
    caplog.set_level(logging.DEBUG)

    # The ledger Redis goes away and comes back under a live worker: its lease warnings are logged.
    survivor = workers.start("other@test", env=env)
    private_redis.stop()
    wait_for(lambda: "cannot renew the lease" in survivor.log(), 10, "the survivor to lose its Redis")
    private_redis.start()
    wait_for(lambda: "renewed again" in survivor.log(), 10, "the survivor's lease to come back")
    doomed = workers.start("secret@test", env=env, queues=("secret-only",))
    result = summarize.apply_async(([1, 2],), {"seconds": 30}, queue="secret-only")
    wait_for(lambda: TaskResult.objects.filter(task_id=result.id, status="STARTED").exists(), 20, "a start")
    doomed.kill()
    workers.start("reader@test", env=env, queues=("secret-only",))

    def recovered() -> bool:
        return any(o.done and o.decision.action is Action.RECOVER for o in sweep_now().outcomes)

    wait_for(recovered, 20, "the orphan to be recovered", interval=0.3)
    assert result.get(timeout=60) == 3

    assert OrphanEvent.objects.filter(task_id=result.id, action="recovered").exists()
    assert_secret_absent(
        private_redis.password,
        test_logs=caplog.text,
        worker_logs="".join(w.log() for w in workers),
        audit_rows=audit_text(),
        **admin_pages(admin_client),
    )


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("failure", ["server-down", "wrong-password"])
def test_redis_password_is_in_no_error_when_the_ledger_redis_fails(
    failure: str, private_redis: RedisServer, settings: Any, caplog: Any, admin_client: Any
) -> None:
    secret = private_redis.password
    if failure == "server-down":
        private_redis.stop()
        url = private_redis.url()
    else:
        url = private_redis.url(password=f"wrong-{secret}")
        secret = f"wrong-{secret}"
    settings.CELERY_ORPHANS_REDIS_URL = url
    caplog.set_level(logging.DEBUG)

    with pytest.raises(LedgerUnavailable) as raised:
        sweep_now()
    with pytest.raises(CommandError) as command_error:
        call_command("reconcile_orphan_tasks")
    pages = admin_pages(admin_client)

    assert "Could not judge the running tasks" in pages["in-flight admin view"]
    assert_secret_absent(
        secret,
        exception=f"{raised.value!r} {raised.value} {raised.value.__cause__!r}",
        command_error=str(command_error.value),
        test_logs=caplog.text,
        audit_rows=audit_text(),
        **pages,
    )
