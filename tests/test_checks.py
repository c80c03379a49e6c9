from __future__ import annotations

import logging
import os
import secrets
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from celery import Task
from django.core.checks import CheckMessage, Error, Info, Warning, run_checks
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.db import connections
from django.db.utils import ConnectionHandler
from pytest_django import Settings
from testproject.celery import app

from celery_orphans import checks, preflight, recoverable
from celery_orphans.checks import deployment
from tests.celery_conf import patch_setting
from tests.helpers import ROOT
from tests.workers import WorkerPool

SetConf = Callable[..., None]
MakeTask = Callable[..., "Task[Any, Any]"]
AMQP = "amqp://guest:guest@127.0.0.1:5672//"
PROJECT = Path(__file__).resolve().parent.parent / "testproject"


@pytest.fixture(autouse=True)
def only_the_projects_own_tasks() -> Iterator[None]:
    """The checks are judged on the test project's own tasks. The no-harm suite's (demoapp/noharm.py),
    registered once any test imported them, include a recoverable task that ignores its result on
    purpose, which W004 names: hidden from the app while each test here runs."""
    app.finalize(auto=True)
    hidden = {name: app.tasks.pop(name) for name in list(app.tasks) if name.startswith("noharm.")}
    yield
    app.tasks.update(hidden)


def run() -> list[CheckMessage]:
    return run_checks(tags=[checks.TAG])


def ids(messages: list[CheckMessage]) -> list[str]:
    return [m.id or "" for m in messages]


def only(messages: list[CheckMessage], check_id: str) -> CheckMessage:
    assert ids(messages) == [check_id], [str(m) for m in messages]
    return messages[0]


@pytest.fixture
def celery_conf(monkeypatch: pytest.MonkeyPatch) -> SetConf:
    """Change the Celery app's config for one test; monkeypatch puts every value back."""
    # Celery's conf prefers these environment variables to its own values.
    monkeypatch.delenv("CELERY_BROKER_URL", raising=False)
    monkeypatch.delenv("CELERY_RESULT_BACKEND", raising=False)

    def set_conf(**values: Any) -> None:
        for key, value in values.items():
            patch_setting(monkeypatch, app.conf, key, value)

    return set_conf


@pytest.fixture
def make_task() -> Iterator[MakeTask]:
    """Register throwaway tasks on the test project's app, removed again afterwards."""
    app.finalize(auto=True)
    names: list[str] = []

    def make(*, mark: bool = True, **options: Any) -> Task[Any, Any]:
        name = f"tests.checks.{uuid.uuid4().hex}"
        names.append(name)

        def throwaway() -> None:
            pass

        task = app.task(name=name, shared=False, **options)(throwaway)
        return recoverable(task) if mark else task

    yield make
    for name in names:
        app.tasks.pop(name, None)


@pytest.fixture
def no_redis_url(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    del settings.CELERY_ORPHANS_REDIS_URL
    monkeypatch.delenv("CELERY_ORPHANS_REDIS_URL", raising=False)


def test_current_app_is_the_test_projects() -> None:
    from celery import current_app

    assert current_app.conf is app.conf  # the fixtures above change the config the checks read


@pytest.mark.parametrize("broker", ["redis://127.0.0.1:6379/0", AMQP])
def test_recommended_configuration_is_quiet(celery_conf: SetConf, broker: str) -> None:
    celery_conf(broker_url=broker)
    for check in (checks.check_celery, checks.check_tasks, checks.check_settings, checks.check_database):
        assert check() == []
    assert run() == []


def test_check_command_passes_on_the_recommended_configuration() -> None:
    out = StringIO()
    call_command("check", stdout=out, stderr=out)
    assert "System check identified no issues" in out.getvalue()


def test_check_command_fails_on_an_error(celery_conf: SetConf) -> None:
    celery_conf(task_track_started=False)
    with pytest.raises(SystemCheckError, match=r"celery_orphans\.E002"):
        call_command("check", stdout=StringIO(), stderr=StringIO())


def test_check_command_reports_a_warning_without_failing(celery_conf: SetConf) -> None:
    celery_conf(worker_prefetch_multiplier=4)
    err = StringIO()
    call_command("check", stdout=StringIO(), stderr=err)
    assert "celery_orphans.W003" in err.getvalue()
    assert "worker_prefetch_multiplier" in err.getvalue()


def test_manage_py_check_imports_the_tasks_it_checks(tmp_path: Path) -> None:
    # A fresh process, where nothing has imported demoapp.tasks: the task checks must find it themselves.
    (tmp_path / "long_limit_settings.py").write_text(
        "from testproject.test_settings import *  # noqa: F403\nCELERY_TASK_TIME_LIMIT = 7200\n"
    )
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "long_limit_settings", "PYTHONPATH": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "manage.py", "check", "--tag", checks.TAG],
        cwd=PROJECT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr  # warnings only
    assert "demoapp.summarize: (celery_orphans.W001)" in result.stderr
    assert "demoapp.scan" not in result.stderr


@pytest.mark.parametrize(
    ("backend", "problem"),
    [
        ("redis://127.0.0.1:6379/1", "is not django-celery-results' database backend"),
        ("django-cache", "is not django-celery-results' database backend"),
        (None, "is not django-celery-results' database backend"),
        ("no_such_module.backends:Backend", "cannot be loaded"),
    ],
)
def test_e001_result_backend_must_be_django_db(
    celery_conf: SetConf, backend: str | None, problem: str
) -> None:
    celery_conf(result_backend=backend)
    message = only(run(), "celery_orphans.E001")
    assert isinstance(message, Error)
    assert problem in message.msg
    assert message.hint is not None
    assert 'result_backend = "django-db"' in message.hint


@pytest.mark.parametrize(
    "backend",
    [
        "django_celery_results.backends:DatabaseBackend",
        "django_celery_results.backends.database.DatabaseBackend",
        "tests.test_checks:SubclassedDatabaseBackend",
    ],
)
def test_e001_accepts_the_database_backend_by_path(celery_conf: SetConf, backend: str) -> None:
    celery_conf(result_backend=backend)
    assert run() == []


def _subclassed_database_backend() -> type:
    from django_celery_results.backends import DatabaseBackend

    return type("SubclassedDatabaseBackend", (DatabaseBackend,), {})


SubclassedDatabaseBackend = _subclassed_database_backend()


@pytest.mark.parametrize(("key", "check_id"), [("task_track_started", "E002"), ("result_extended", "E003")])
def test_e002_e003_required_celery_switches(celery_conf: SetConf, key: str, check_id: str) -> None:
    celery_conf(**{key: False})
    message = only(run(), f"celery_orphans.{check_id}")
    assert isinstance(message, Error)
    assert f"{key} is False" in message.msg
    assert message.hint is not None
    assert f"Set {key} = True" in message.hint
    assert f"CELERY_{key.upper()}" in message.hint


def test_e004_recoverable_task_without_acks_late(make_task: MakeTask) -> None:
    task = make_task(acks_late=False)  # the app default is True, so @recoverable keeps the author's choice
    assert task.acks_late is False
    message = only(run(), "celery_orphans.E004")
    assert isinstance(message, Error)
    assert message.obj == task.name
    assert repr(task.name) in message.msg


def test_w004_recoverable_task_that_ignores_its_result(make_task: MakeTask) -> None:
    task = make_task(ignore_result=True)
    message = only(run(), "celery_orphans.W004")
    assert isinstance(message, Warning)
    assert message.obj == task.name
    assert "ignore_result=True" in message.msg


def test_task_checks_ignore_tasks_that_are_not_recoverable(make_task: MakeTask) -> None:
    make_task(mark=False, acks_late=False, ignore_result=True, time_limit=7200)
    assert run() == []


@pytest.mark.parametrize("time_limit", [3600, 7200])
def test_w001_time_limit_reaching_the_visibility_timeout(make_task: MakeTask, time_limit: int) -> None:
    task = make_task(time_limit=time_limit)
    message = only(run(), "celery_orphans.W001")
    assert isinstance(message, Warning)
    assert message.obj == task.name
    assert f"{time_limit}s" in message.msg
    assert "3600s" in message.msg


def test_w001_uses_task_time_limit_from_the_config(celery_conf: SetConf, make_task: MakeTask) -> None:
    task = make_task()
    celery_conf(task_time_limit=4000)
    warned = [m.obj for m in run() if m.id == "celery_orphans.W001"]
    assert task.name in warned
    assert "demoapp.summarize" in warned
    assert "demoapp.scan" not in warned


@pytest.mark.parametrize(
    ("broker", "transport_options"),
    [
        ("redis://127.0.0.1:6379/0", {"visibility_timeout": 7201}),  # raised above the limit
        (AMQP, {}),  # RabbitMQ re-delivers on a lost connection, not after a timeout
    ],
)
def test_w001_quiet_when_the_limit_is_below_the_timeout_or_the_broker_is_not_redis(
    celery_conf: SetConf, make_task: MakeTask, broker: str, transport_options: dict[str, int]
) -> None:
    celery_conf(broker_url=broker, broker_transport_options=transport_options)
    make_task(time_limit=7200)
    assert run() == []


def test_e006_redis_url_missing_without_a_redis_broker(celery_conf: SetConf, no_redis_url: None) -> None:
    celery_conf(broker_url=AMQP)
    message = only(run(), "celery_orphans.E006")
    assert "CELERY_ORPHANS_REDIS_URL is not set" in message.msg
    assert message.hint is not None
    assert "CELERY_ORPHANS_REDIS_URL" in message.hint


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("sentinel://127.0.0.1:26379/0", "no master name is set"),
        ("sentinel://:pw-s3cret@127.0.0.1:26379/x", "not a valid sentinel URL: the database of a sentinel"),
    ],
)
def test_e006_a_sentinel_url_needs_its_master_name_and_a_valid_form(
    celery_conf: SetConf, settings: Any, url: str, message: str
) -> None:
    celery_conf(broker_url=AMQP, broker_transport_options={})
    settings.CELERY_ORPHANS_REDIS_URL = url
    found = only(run(), "celery_orphans.E006")
    assert message in found.msg
    assert "pw-s3cret" not in found.msg
    assert found.hint is not None and "CELERY_ORPHANS_REDIS_SENTINEL_MASTER" in found.hint


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("http://:pw-s3cret@127.0.0.1:6379/0", "has the scheme 'http'"),
        ("pw-s3cret", "is not a URL"),
        ("redis://:pw-s3cret@:6379/0", "names no host"),
    ],
)
def test_e006_a_redis_url_no_client_can_use(settings: Settings, url: str, problem: str) -> None:
    settings.CELERY_ORPHANS_REDIS_URL = url
    found = only(run(), "celery_orphans.E006")
    assert isinstance(found, Error)
    assert found.msg.startswith(f"CELERY_ORPHANS_REDIS_URL {problem}")
    assert "pw-s3cret" not in found.msg
    assert found.hint is not None and "redis://[:password@]host:port/db" in found.hint


def test_e006_quiet_for_a_sentinel_url_with_its_master(celery_conf: SetConf, settings: Any) -> None:
    celery_conf(broker_url=AMQP)
    settings.CELERY_ORPHANS_REDIS_URL = "sentinel://127.0.0.1:26379/0"
    settings.CELERY_ORPHANS_REDIS_SENTINEL_MASTER = "orphans"
    assert run() == []


def test_e006_quiet_when_the_broker_is_redis(celery_conf: SetConf, no_redis_url: None) -> None:
    celery_conf(broker_url="rediss://127.0.0.1:6379/0")
    assert run() == []


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        ("MAX_ATTEMPTS", 0, "at least 1"),
        ("ENABLED", "maybe", "a boolean"),
        ("GRACE_SECONDS", -1, "at least 0"),
        ("GROUPS", ["summaries"], "a mapping"),
        ("KEY_PREFIX", "has space", "without spaces"),
        ("REDIS_URL", 6379, "a string"),
    ],
)
def test_e007_bad_setting(settings: Settings, name: str, value: object, expected: str) -> None:
    setattr(settings, f"CELERY_ORPHANS_{name}", value)
    message = only(run(), "celery_orphans.E007")
    assert isinstance(message, Error)
    assert f"CELERY_ORPHANS_{name}" in message.msg
    assert repr(value) in message.msg
    assert expected in message.msg
    assert message.hint is not None
    assert f"CELERY_ORPHANS_{name}" in message.hint


def test_e007_bad_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CELERY_ORPHANS_GROUPS", "{not json")
    message = only(run(), "celery_orphans.E007")
    assert "CELERY_ORPHANS_GROUPS" in message.msg
    assert "'{not json'" in message.msg


def test_e007_one_error_per_bad_setting_and_no_crash_in_checks_that_read_them(
    settings: Settings,
) -> None:
    settings.CELERY_ORPHANS_LEASE_SECONDS = "long"
    settings.CELERY_ORPHANS_HEARTBEAT_SECONDS = 0
    settings.CELERY_ORPHANS_ATTEMPTS_WINDOW_SECONDS = "a day"
    messages = run()
    assert ids(messages) == ["celery_orphans.E007"] * 3
    assert {m.msg.split(" ")[0] for m in messages} == {
        "CELERY_ORPHANS_LEASE_SECONDS",
        "CELERY_ORPHANS_HEARTBEAT_SECONDS",
        "CELERY_ORPHANS_ATTEMPTS_WINDOW_SECONDS",
    }


@pytest.mark.parametrize(("lease", "heartbeat", "skew"), [(6.5, 2, 0.5), (10, 4, 0), (6.6, 2, 1)])
def test_e008_lease_shorter_than_three_heartbeats_the_skew_and_the_forfeit_latency(
    settings: Settings, lease: float, heartbeat: float, skew: float
) -> None:
    settings.CELERY_ORPHANS_LEASE_SECONDS = lease
    settings.CELERY_ORPHANS_HEARTBEAT_SECONDS = heartbeat
    settings.CELERY_ORPHANS_CLOCK_SKEW_SECONDS = skew
    message = only(run(), "celery_orphans.E008")
    assert message.hint is not None
    assert f"at least {3 * heartbeat + skew + 0.1:g}" in message.hint
    assert "CELERY_ORPHANS_CLOCK_SKEW_SECONDS" in message.msg


def test_e008_quiet_at_exactly_three_heartbeats_the_skew_and_the_forfeit_latency(settings: Settings) -> None:
    settings.CELERY_ORPHANS_LEASE_SECONDS = 6.6
    settings.CELERY_ORPHANS_HEARTBEAT_SECONDS = 2
    settings.CELERY_ORPHANS_CLOCK_SKEW_SECONDS = 0.5
    assert run() == []


def test_the_defaults_leave_a_lease_room_for_two_renewals_after_the_margin() -> None:
    from celery_orphans.conf import settings as orphans_settings

    assert orphans_settings.LEASE_SECONDS - orphans_settings.lease_margin() >= (
        2 * orphans_settings.HEARTBEAT_SECONDS
    )


@pytest.mark.parametrize(
    ("start_method", "broker", "refused"),
    [
        ("spawn", "filesystem://", True),  # no event loop: billiard's plain pool, which hands nothing over
        ("spawn", "redis://127.0.0.1:6379/0", False),
        ("spawn", AMQP, False),
        ("fork", "filesystem://", False),  # a forked process inherits the validity
    ],
)
def test_e013_pool_processes_the_validity_cannot_reach(
    celery_conf: SetConf, start_method: str, broker: str, refused: bool
) -> None:
    celery_conf(worker_pool_start_method=start_method, broker_url=broker)
    found = [m for m in run() if m.id == "celery_orphans.E013"]
    assert bool(found) == refused
    if refused:
        assert "'spawn'" in found[0].msg and "'filesystem'" in found[0].msg
        assert found[0].hint is not None and "'fork'" in found[0].hint


def test_e013_leaves_a_worker_of_another_pool_alone(celery_conf: SetConf) -> None:
    celery_conf(worker_pool_start_method="spawn", broker_url="filesystem://", worker_pool="threads")
    assert "celery_orphans.E013" not in [m.id for m in run()]


def test_e009_stall_timeout_not_above_the_inspect_timeout(settings: Settings) -> None:
    settings.CELERY_ORPHANS_SWEEP_STALL_SECONDS = 2
    settings.CELERY_ORPHANS_INSPECT_TIMEOUT_SECONDS = 2
    message = only(run(), "celery_orphans.E009")
    assert "replies inside its transaction" in message.msg


def test_e009_quiet_above_the_inspect_timeout(settings: Settings) -> None:
    settings.CELERY_ORPHANS_SWEEP_STALL_SECONDS = 2.5
    settings.CELERY_ORPHANS_INSPECT_TIMEOUT_SECONDS = 2
    assert run() == []


def assert_names_the_setting(message: CheckMessage, kind: type[CheckMessage], text: str, meant: str) -> None:
    """An unknown name reported as ``kind``, saying ``text``, with the setting it resembles as its hint."""
    assert isinstance(message, kind)
    assert text in message.msg
    assert message.hint is not None
    assert message.hint.startswith(f"Did you mean {meant}?")


@pytest.mark.parametrize(
    ("typed", "meant"),
    [
        ("SHADOWMODE", "CELERY_ORPHANS_SHADOW_MODE"),
        ("ENABLE", "CELERY_ORPHANS_ENABLED"),
        ("GRACE", "CELERY_ORPHANS_GRACE_SECONDS"),  # the start of one setting's name
        ("REDIS", "CELERY_ORPHANS_REDIS_URL"),
    ],
)
def test_e011_unknown_django_setting_names_the_setting_it_resembles(
    settings: Settings, typed: str, meant: str
) -> None:
    setattr(settings, f"CELERY_ORPHANS_{typed}", True)
    message = only(run(), "celery_orphans.E011")
    assert_names_the_setting(message, Error, f"CELERY_ORPHANS_{typed} is not a celery-orphans setting", meant)


def test_e011_one_error_per_unknown_name_and_none_for_the_known_ones(settings: Settings) -> None:
    settings.CELERY_ORPHANS_SHADOW_MODE = True
    settings.CELERY_ORPHANS_NOTHING_LIKE_IT = 1
    settings.CELERY_ORPHANS_SHADOWMODE = True
    messages = run()
    assert ids(messages) == ["celery_orphans.E011"] * 2
    nothing = next(m for m in messages if "NOTHING_LIKE_IT" in m.msg)
    assert nothing.hint is not None
    assert nothing.hint.startswith("Remove it, or correct its name.")


@pytest.mark.parametrize(
    ("name", "meant"),
    [
        ("CELERY_ORPHANS_SHADOWMODE", "CELERY_ORPHANS_SHADOW_MODE"),
        ("celery_orphans_shadow_mode", "CELERY_ORPHANS_SHADOW_MODE"),  # names are upper case
    ],
)
def test_w005_unknown_environment_variable(monkeypatch: pytest.MonkeyPatch, name: str, meant: str) -> None:
    monkeypatch.setenv(name, "true")
    message = only(run(), "celery_orphans.W005")
    assert_names_the_setting(
        message, Warning, f"environment variable {name} is not a celery-orphans setting", meant
    )


def test_check_command_fails_on_a_misspelled_setting(settings: Settings) -> None:
    settings.CELERY_ORPHANS_SHADOWMODE = True
    with pytest.raises(SystemCheckError, match=r"celery_orphans\.E011") as raised:
        call_command("check", stdout=StringIO(), stderr=StringIO())
    assert "Did you mean CELERY_ORPHANS_SHADOW_MODE?" in str(raised.value)


def test_w002_attempts_window_shorter_than_the_visibility_timeout(
    settings: Settings, celery_conf: SetConf
) -> None:
    celery_conf(broker_transport_options={"visibility_timeout": 7200})
    settings.CELERY_ORPHANS_ATTEMPTS_WINDOW_SECONDS = 7199
    message = only(run(), "celery_orphans.W002")
    assert isinstance(message, Warning)
    assert message.hint is not None
    assert "at least 7200" in message.hint


def test_w002_uses_the_default_visibility_timeout_of_redis(settings: Settings, celery_conf: SetConf) -> None:
    celery_conf(broker_transport_options={})
    settings.CELERY_ORPHANS_ATTEMPTS_WINDOW_SECONDS = 3599
    assert ids(run()) == ["celery_orphans.W002"]
    settings.CELERY_ORPHANS_ATTEMPTS_WINDOW_SECONDS = 3600
    assert run() == []


def test_w002_quiet_without_a_redis_broker(settings: Settings, celery_conf: SetConf) -> None:
    celery_conf(broker_url=AMQP)
    settings.CELERY_ORPHANS_ATTEMPTS_WINDOW_SECONDS = 60
    assert run() == []


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("task_reject_on_worker_lost", False),
        ("task_reject_on_worker_lost", None),
        ("worker_prefetch_multiplier", 4),
        ("worker_prefetch_multiplier", 0),
        ("worker_deduplicate_successful_tasks", False),
        ("worker_soft_shutdown_timeout", 0.0),
    ],
)
def test_w003_recommended_setting_missing(celery_conf: SetConf, key: str, value: object) -> None:
    celery_conf(**{key: value})
    message = only(run(), "celery_orphans.W003")
    assert isinstance(message, Warning)
    assert f"{key} is {value!r}: " in message.msg
    assert message.hint is not None
    assert f"CELERY_{key.upper()}" in message.hint


def test_w003_one_warning_per_missing_setting(celery_conf: SetConf) -> None:
    celery_conf(worker_prefetch_multiplier=4, worker_soft_shutdown_timeout=0.0)
    messages = run()
    assert ids(messages) == ["celery_orphans.W003"] * 2
    soft_shutdown = next(m for m in messages if "worker_soft_shutdown_timeout" in m.msg)
    assert soft_shutdown.hint is not None
    assert "SIGQUIT" in soft_shutdown.hint
    assert "REMAP_SIGTERM=SIGQUIT" in soft_shutdown.hint


@pytest.fixture
def sqlite_default() -> Iterator[None]:
    """A real SQLite connection in place of the default one (never opened: the check reads the vendor)."""
    postgresql = connections["default"]
    connections["default"] = ConnectionHandler(
        {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}}
    )["default"]
    yield
    connections["default"] = postgresql


def test_i001_default_database_is_not_postgresql(sqlite_default: None) -> None:
    message = only(run(), "celery_orphans.I001")
    assert isinstance(message, Info)
    assert "The default database is sqlite" in message.msg


# --- a worker runs the checks as it starts --------------------------------------------------------


@pytest.mark.worker
@pytest.mark.parametrize(
    ("settings_line", "env", "expected"),
    [
        (
            "CELERY_ORPHANS_SHADOWMODE = True",
            {},
            "celery_orphans.E011: The Django setting CELERY_ORPHANS_SHADOWMODE is not a celery-orphans "
            "setting: nothing reads it. HINT: Did you mean CELERY_ORPHANS_SHADOW_MODE?",
        ),
        (
            "",
            {"CELERY_ORPHANS_REDIS_URL": "http://:pw-s3cret@127.0.0.1:6379/0"},
            "celery_orphans.E006: CELERY_ORPHANS_REDIS_URL has the scheme 'http'",
        ),
        (
            # No-harm's differential cell for result_extended off: plain Celery runs; this worker refuses,
            # since its rows would not name the task, its arguments or its worker (docs/supported.md).
            "CELERY_RESULT_EXTENDED = False",
            {},
            "celery_orphans.E003: Celery setting result_extended is False: result rows lack the task name, "
            "arguments and worker.",
        ),
    ],
    ids=["misspelled", "http_url", "result_extended_off"],
)
def test_a_misconfigured_worker_says_why_in_one_line_and_does_not_start(
    workers: WorkerPool,
    redis_client: Any,
    tmp_path: Path,
    settings_line: str,
    env: dict[str, str],
    expected: str,
) -> None:
    (tmp_path / "worker_settings.py").write_text(
        f"from testproject.test_settings import *  # noqa: F403\n{settings_line}\n"
    )
    worker = workers.start(
        "misconfigured@test",
        wait=False,
        env={
            "DJANGO_SETTINGS_MODULE": "worker_settings",
            "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}",
            **env,
        },
    )

    assert worker.process.wait(timeout=60) == preflight.EXIT_CONFIG
    log = worker.log()
    [line] = [line for line in log.splitlines() if expected.split(":")[0] in line]
    assert expected in line
    assert "worker misconfigured@test will not start: 1 configuration error above" in log
    assert " ready." not in log
    assert "Traceback" not in log
    assert "pw-s3cret" not in log
    assert redis_client.keys("*:lease:misconfigured@test:*") == []  # it took no lease


@pytest.mark.worker
def test_a_worker_logs_an_unknown_environment_variable_in_one_line_and_starts(
    workers: WorkerPool, redis_client: Any
) -> None:
    worker = workers.start("w005@test", env={"CELERY_ORPHANS_SHADOWMODE": "true"})

    [line] = [line for line in worker.log().splitlines() if "celery_orphans.W005" in line]
    assert "CELERY_ORPHANS_SHADOWMODE" in line and "HINT: Did you mean CELERY_ORPHANS_SHADOW_MODE?" in line
    assert redis_client.keys("*:lease:w005@test:*")


def test_the_preflight_stops_on_errors_only_and_honours_silenced_checks(
    settings: Settings, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CELERY_ORPHANS_WATCHH", "false")
    with caplog.at_level(logging.WARNING, logger="celery_orphans.preflight"):
        preflight.check_worker("w@test")  # a warning: logged, the worker goes on
    assert [r.levelname for r in caplog.records] == ["WARNING"]

    settings.CELERY_ORPHANS_SHADOWMODE = True
    with pytest.raises(SystemExit) as exited:
        preflight.check_worker("w@test")
    assert exited.value.code == preflight.EXIT_CONFIG

    settings.SILENCED_SYSTEM_CHECKS = ["celery_orphans.E011"]
    preflight.check_worker("w@test")


# --- E012, W006: pickle ----------------------------------------------------------------------------


@pytest.mark.parametrize("serializer", ["pickle", "application/x-python-serialize", "yaml"])
def test_e012_recoverable_task_sent_pickled(make_task: MakeTask, serializer: str) -> None:
    task = make_task(serializer=serializer)
    message = only(run(), "celery_orphans.E012")
    assert isinstance(message, Error)
    assert message.obj == task.name
    assert repr(task.name) in message.msg and repr(serializer) in message.msg


def test_e012_follows_the_apps_task_serializer(celery_conf: SetConf, make_task: MakeTask) -> None:
    celery_conf(task_serializer="pickle")
    task = make_task()
    assert task.serializer == "pickle"
    assert {m.obj for m in run() if m.id == "celery_orphans.E012"} >= {task.name}


@pytest.mark.parametrize("serializer", ["json", "msgpack"])
def test_e012_quiet_for_data_serializers_and_tasks_that_are_not_recoverable(
    make_task: MakeTask, serializer: str
) -> None:
    make_task(serializer=serializer)
    make_task(mark=False, serializer="pickle")
    assert run() == []


def test_w006_workers_accepting_pickle_while_tasks_are_recoverable(celery_conf: SetConf) -> None:
    celery_conf(accept_content=["json", "pickle"])
    message = only(run(), "celery_orphans.W006")
    assert isinstance(message, Warning)
    assert "'pickle'" in message.msg


def test_check_command_fails_on_a_pickled_recoverable_task(make_task: MakeTask) -> None:
    make_task(serializer="pickle")
    with pytest.raises(SystemCheckError, match=r"celery_orphans\.E012"):
        call_command("check")


@pytest.mark.parametrize("token", ["short", "a token with spaces in it, long enough"])
def test_e007_a_status_token_too_short_or_with_spaces_is_refused_without_repeating_it(
    settings: Settings, token: str
) -> None:
    settings.CELERY_ORPHANS_STATUS_TOKEN = token
    message = only(run(), "celery_orphans.E007")
    assert "CELERY_ORPHANS_STATUS_TOKEN" in message.msg
    assert token not in message.msg and token not in (message.hint or "")


# --- W007, W008: with --deploy only -----------------------------------------------------------------


def deploy() -> list[CheckMessage]:
    return run_checks(tags=[checks.TAG], include_deployment_checks=True)


@pytest.mark.parametrize(("installed", "warned"), [("5.2.1", True), ("7.3.9", True), ("7.4.0", False)])
def test_w007_a_redis_client_that_prints_passwords_is_named_with_deploy_only(
    monkeypatch: pytest.MonkeyPatch, installed: str, warned: bool
) -> None:
    monkeypatch.setattr(deployment, "version", lambda name: installed if name == "redis" else "0")
    assert run() == []  # a development machine is left alone
    if not warned:
        assert deploy() == []
        return
    message = only(deploy(), "celery_orphans.W007")
    assert f"redis-py {installed}" in message.msg and "CVE-2026-32597" in message.msg
    assert "redis>=7.4" in (message.hint or "")


@pytest.mark.parametrize(
    ("key", "fallbacks", "named"),
    [
        ("short", [], ["CELERY_ORPHANS_SIGNING_KEY"]),
        ("ab" * 40, [], ["CELERY_ORPHANS_SIGNING_KEY"]),  # long, but four distinct characters
        (secrets.token_urlsafe(50), ["old"], ["CELERY_ORPHANS_SIGNING_KEY_FALLBACKS[0]"]),
        (secrets.token_urlsafe(50), [secrets.token_urlsafe(50)], []),
        (None, [], []),  # SECRET_KEY seals the entries: Django's security.W009 judges it
    ],
)
def test_w008_a_weak_signing_key_is_named_without_repeating_it(
    settings: Settings,
    monkeypatch: pytest.MonkeyPatch,
    key: str | None,
    fallbacks: list[str],
    named: list[str],
) -> None:
    monkeypatch.setattr(deployment, "version", lambda name: "7.4.0")
    settings.CELERY_ORPHANS_SIGNING_KEY = key
    settings.CELERY_ORPHANS_SIGNING_KEY_FALLBACKS = fallbacks

    found = deploy()

    assert ids(found) == ["celery_orphans.W008"] * len(named)
    for message, name in zip(found, named):
        assert message.msg.startswith(f"{name} has fewer than 50 characters")
        assert all(k not in message.msg + (message.hint or "") for k in [key or "", *fallbacks] if len(k) > 4)
