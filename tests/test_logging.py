"""What celery-orphans logs: one summary line per sweep, one line per action, and never a password."""

from __future__ import annotations

import logging
import re
import secrets
import subprocess
from collections.abc import Iterator

import pytest
import redis
from celery import Celery
from django.core.management import call_command
from django.test import override_settings
from django_celery_results.models import TaskResult

from celery_orphans import logs, sweep
from celery_orphans.decision import Action
from celery_orphans.exceptions import LedgerUnavailable
from celery_orphans.models import Trigger
from tests import factories
from tests.celery_conf import patch_setting, set_setting
from tests.helpers import manage, wait_for
from tests.services import RedisServer, free_port

pytestmark = pytest.mark.django_db(transaction=True)

SUMMARY = re.compile(
    r"^celery-orphans: (?:would have )?recovered (\d+) orphaned tasks, "
    r"(?:would have )?marked (\d+) terminal, (?:would have )?forgotten (\d+) finished, "
    r"(\d+) alive or in grace, (\d+) unreadable \(\d+\.\d\ds\)$"
)


def messages(caplog: pytest.LogCaptureFixture, logger: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == logger]


# --- one summary line per sweep ------------------------------------------------------------------


def three_orphans_and_one_running() -> dict[str, str]:
    """A recoverable orphan, one that is not, one that already ended, and a task still in grace."""
    finished = factories.orphan("demoapp.summarize")
    TaskResult.objects.filter(task_id=finished).update(status="SUCCESS")
    return {
        "recover": factories.orphan("demoapp.summarize"),
        "mark_terminal": factories.orphan("demoapp.scan", ("db",)),
        "forget": finished,
        "leave": factories.orphan("demoapp.summarize", started_ago=0),
    }


@pytest.mark.parametrize(("dry_run", "shadow"), [(False, False), (True, False), (False, True)])
def test_every_sweep_logs_one_summary_line_with_its_counts(redis_client, caplog, dry_run, shadow):
    three_orphans_and_one_running()
    with caplog.at_level(logging.DEBUG, logger="celery_orphans"):
        sweep.run(sweep.Options(trigger=Trigger.COMMAND, grace_seconds=1, dry_run=dry_run, shadow=shadow))

    (line,) = messages(caplog, "celery_orphans.sweep.runner")
    assert line.levelno == logging.INFO
    found = SUMMARY.match(line.getMessage())
    assert found, line.getMessage()
    assert [int(n) for n in found.groups()] == [1, 1, 1, 1, 0]
    assert ("would have recovered" in line.getMessage()) is (dry_run or shadow)


def test_a_sweep_with_nothing_to_judge_logs_its_summary_at_debug_level(redis_client, caplog):
    with caplog.at_level(logging.DEBUG, logger="celery_orphans"):
        sweep.run(sweep.Options(trigger=Trigger.COMMAND))

    (line,) = messages(caplog, "celery_orphans.sweep.runner")
    assert line.levelno == logging.DEBUG
    assert SUMMARY.match(line.getMessage())


def test_a_sweep_that_only_finds_what_it_can_report_says_so_at_info_once(redis_client, caplog):
    sweep.run(sweep.Options(trigger=Trigger.BEAT))  # the process's first sweep sets up Celery's logging
    factories.orphan(started_ago=-3600, entry=False)  # its start is an hour ahead: unreadable, audited
    factories.orphan("demoapp.no_such_task", entry=False)  # not registered here: reported, not audited
    with caplog.at_level(logging.DEBUG, logger="celery_orphans"):
        sweep.run(sweep.Options(trigger=Trigger.BEAT))
        (first,) = messages(caplog, "celery_orphans.sweep.runner")
        caplog.clear()
        sweep.run(sweep.Options(trigger=Trigger.BEAT))
        sweep.run(sweep.Options(trigger=Trigger.BEAT))
        again = messages(caplog, "celery_orphans.sweep.runner")

    # The first sweep reported the unreadable record (its audit row is new); the next find nothing new.
    assert first.levelno == logging.INFO
    assert "1 unreadable, 1 of a task not registered here" in first.getMessage()
    assert [r.levelno for r in again] == [logging.DEBUG, logging.DEBUG]
    said = first.getMessage().rsplit(" (", 1)[0]  # the same counts; the duration may differ
    assert [r.getMessage().rsplit(" (", 1)[0] for r in again] == [said, said]


# --- one line per action -------------------------------------------------------------------------


@pytest.mark.parametrize("shadow", [False, True])
def test_every_action_logs_one_line_with_the_task_id_name_worker_and_reason(redis_client, caplog, shadow):
    tasks = three_orphans_and_one_running()
    expected = {
        tasks["recover"]: ("demoapp.summarize", "recoverable"),
        tasks["mark_terminal"]: ("demoapp.scan", "not_recoverable"),
        tasks["forget"]: ("demoapp.summarize", "already_finished"),
    }
    with caplog.at_level(logging.DEBUG, logger="celery_orphans"):
        sweep.run(sweep.Options(trigger=Trigger.COMMAND, grace_seconds=1, shadow=shadow))

    records = messages(caplog, "celery_orphans.recovery.executor")
    lines = [r.getMessage() for r in records]
    assert len(lines) == len(expected)
    # Recoveries and terminal marks are what an operator watches for; forgetting is housekeeping.
    levels = {task_id: r.levelno for r in records for task_id in expected if task_id in r.getMessage()}
    assert levels == {
        tasks["recover"]: logging.WARNING,
        tasks["mark_terminal"]: logging.WARNING,
        tasks["forget"]: logging.DEBUG,
    }
    for task_id, (name, reason) in expected.items():
        (line,) = [line for line in lines if task_id in line]
        assert f"{name}[{task_id}]" in line
        assert f"from worker {factories.GHOST}" in line
        assert reason in line
        assert line.startswith("celery-orphans: shadow mode: would have ") is shadow
    assert not any(tasks["leave"] in line for line in lines)


def test_shadow_mode_says_what_it_would_have_done_once_per_orphan(redis_client, caplog):
    tasks = three_orphans_and_one_running()
    options = sweep.Options(trigger=Trigger.BEAT, grace_seconds=1, shadow=True)
    with caplog.at_level(logging.INFO, logger="celery_orphans"):
        sweep.run(options)
        first = [r.getMessage() for r in caplog.records]
        caplog.clear()
        sweep.run(options)
        sweep.run(options)

    [said] = [line for line in first if tasks["recover"] in line]
    assert said.startswith(
        f"celery-orphans: shadow mode: would have recovered demoapp.summarize[{tasks['recover']}]"
    )
    assert caplog.messages == []  # the same orphans again: nothing new to say, not even a summary


# --- no credentials, ever ------------------------------------------------------------------------

PASSWORD = f"s3cret{secrets.token_hex(8)}"


@pytest.fixture
def private_redis(tmp_path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path, password=PASSWORD).start()
    yield server
    server.stop()


def unreachable_url() -> str:
    return f"redis://:{PASSWORD}@127.0.0.1:{free_port()}/0"


def celery_app_with_broker(url: str) -> Celery:
    """The test project's configuration, with ``url`` as the broker."""
    app = Celery("password-test", set_as_current=False)
    app.config_from_object("django.conf:settings", namespace="CELERY")
    set_setting(app.conf, "broker_url", url)
    return app


def assert_no_password(*outputs: str) -> None:
    for output in outputs:
        assert PASSWORD not in output


def test_a_sweep_that_recovers_through_a_password_protected_redis_logs_no_password(
    redis_client, private_redis, caplog, capsys
):
    server = private_redis
    app = celery_app_with_broker(server.url())
    with override_settings(CELERY_ORPHANS_REDIS_URL=server.url()):
        recovered = factories.orphan("demoapp.summarize")
        factories.orphan("demoapp.scan", ("db",))
        with caplog.at_level(logging.DEBUG):
            report = sweep.run(sweep.Options(trigger=Trigger.COMMAND, grace_seconds=0), app)
    app.close()

    assert report.count(Action.RECOVER, done_only=True) == 1
    assert server.client().llen("celery") == 1  # the re-send went through the password-protected broker
    assert recovered in caplog.text
    assert_no_password(caplog.text, *capsys.readouterr())


@pytest.mark.parametrize("failure", ["unreachable", "wrong_password"])
def test_a_sweep_that_cannot_reach_redis_logs_no_password(
    redis_client, private_redis, caplog, capsys, failure
):
    server = private_redis
    redis_url = server.url(password=f"wrong{PASSWORD}") if failure == "wrong_password" else unreachable_url()
    app = celery_app_with_broker(redis_url)
    with (
        override_settings(CELERY_ORPHANS_REDIS_URL=redis_url),
        caplog.at_level(logging.DEBUG),
        pytest.raises(LedgerUnavailable) as raised,
    ):
        sweep.run(sweep.Options(trigger=Trigger.COMMAND, grace_seconds=0), app)
    app.close()

    assert_no_password(str(raised.value), repr(raised.value.__cause__), caplog.text, *capsys.readouterr())


def run_command(redis_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    # The test project's CELERY_ORPHANS_REDIS_URL is REDIS_URL.
    return manage(
        "reconcile_orphan_tasks",
        "-v",
        "3",
        *args,
        env={"REDIS_URL": redis_url, "CELERY_BROKER_URL": redis_url},
    )


def test_the_command_prints_no_password_when_it_recovers(redis_client, private_redis):
    server = private_redis
    with override_settings(CELERY_ORPHANS_REDIS_URL=server.url()):
        task_id = factories.orphan("demoapp.summarize")

    result = run_command(server.url(), "--grace-minutes", "0", "--all")

    assert result.returncode == 0, result.stderr
    assert task_id in result.stdout and "recovered 1 orphaned tasks" in result.stdout
    assert_no_password(result.stdout, result.stderr)


@pytest.mark.parametrize("args", [(), ("--dry-run", "--traceback")], ids=["sweep", "dry_run_traceback"])
def test_the_command_prints_no_password_when_redis_is_unreachable(redis_client, args):
    result = run_command(unreachable_url(), *args)

    assert result.returncode == 1
    assert "cannot reach Redis" in result.stderr
    assert_no_password(result.stdout, result.stderr)


@pytest.mark.worker
def test_a_workers_log_shows_no_password_while_redis_works_and_after_it_goes_away(
    workers, redis_client, private_redis
):
    server = private_redis
    env = {"REDIS_URL": server.url(), "CELERY_BROKER_URL": server.url(), "CELERY_ORPHANS_BOOT_SWEEP": "true"}
    worker = workers.start("secret@test", env=env)
    app = celery_app_with_broker(server.url())
    task_id = app.send_task("demoapp.summarize", args=[[1, 2]]).id
    wait_for(lambda: f"Task demoapp.summarize[{task_id}] succeeded" in worker.log(), 30, "the task to run")
    app.close()

    server.stop()  # Redis, broker and ledger both, goes away
    wait_for(lambda: "cannot renew the lease of secret@test" in worker.log(), 30, "the heartbeat to fail")
    wait_for(lambda: "Cannot connect to redis://" in worker.log(), 30, "the consumer to reconnect")
    worker.kill()

    log = worker.log()
    assert "celery-orphans: lease of secret@test" in log  # the worker did log through celery-orphans
    assert_no_password(log)


def test_the_result_backend_check_prints_no_password(monkeypatch, capsys):
    from django.core.management.base import SystemCheckError
    from testproject.celery import app

    patch_setting(monkeypatch, app.conf, "result_backend", f"redis://:{PASSWORD}@127.0.0.1:6379/1")
    with pytest.raises(SystemCheckError) as raised:
        call_command("check", tags=["celery_orphans"])

    assert "celery_orphans.E001" in str(raised.value)
    assert_no_password(str(raised.value), *capsys.readouterr())


# --- whose line it is ----------------------------------------------------------------------------


def test_a_line_names_celery_orphans_once_and_goes_to_the_modules_logger(caplog):
    logger = logs.get("celery_orphans.sweep.runner")

    with caplog.at_level(logging.INFO, logger="celery_orphans"):
        logger.info("recovered %d orphaned tasks", 3)

    [record] = caplog.records
    assert record.name == "celery_orphans.sweep.runner"
    assert record.getMessage() == "celery-orphans: recovered 3 orphaned tasks"


def test_a_harmless_redis_fault_is_logged_with_what_failed_and_let_go(caplog):
    logger = logs.get("celery_orphans.recovery.executor")
    ran_on = []

    with caplog.at_level(logging.WARNING, logger="celery_orphans"):
        with logs.redis_fault_let_go(logger, "could not remove the checkpoint of %s", "t-1"):
            raise redis.ConnectionError("Connection refused")
        ran_on.append("after")

    assert ran_on == ["after"]
    assert caplog.messages == ["celery-orphans: could not remove the checkpoint of t-1: Connection refused"]


def test_any_other_fault_is_not_let_go():
    logger = logs.get("celery_orphans.recovery.executor")

    with pytest.raises(ValueError, match="a bug"), logs.redis_fault_let_go(logger, "could not do a thing"):
        raise ValueError("a bug")
