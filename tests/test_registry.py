from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from celery import Celery, current_app, shared_task
from django.conf import settings as django_settings
from testproject.celery import app as project_app

from celery_orphans import recoverable
from celery_orphans.registry import (
    POLICY_ATTR,
    RecoveryPolicy,
    policy_of,
    recoverable_tasks,
)
from tests import factories
from tests.helpers import database_url, policy_for

DEMO_POLICIES = {
    "demoapp.summarize": RecoveryPolicy(group="summaries"),
    "demoapp.add": RecoveryPolicy(),
    "demoapp.echo": RecoveryPolicy(),
    "demoapp.collect": RecoveryPolicy(),
    "demoapp.poison": RecoveryPolicy(max_attempts=2),
}


def noop() -> Callable[[], None]:
    """A new function each time: @recoverable marks the function too, so tasks must not share one."""

    def run() -> None:
        pass

    return run


def bound_noop() -> Callable[[object], None]:
    def run(self: object) -> None:
        pass

    return run


def unique() -> str:
    return f"tests.registry.{uuid.uuid4().hex}"


@pytest.fixture
def project_names() -> Iterator[list[str]]:
    project_app.finalize(auto=True)
    names: list[str] = []
    yield names
    for name in names:
        project_app.tasks.pop(name, None)


@pytest.fixture(autouse=True)
def demo_tasks() -> None:
    import demoapp.tasks  # noqa: F401  (registers the demo tasks on the test project's app)


def test_policies_of_the_demo_tasks() -> None:
    for name, policy in DEMO_POLICIES.items():
        assert policy_for(name) == policy
    assert policy_for("demoapp.scan") is None  # not idempotent, never marked


def test_unknown_task_has_no_policy_and_is_not_registered() -> None:
    name = unique()
    assert policy_for(name) is None
    assert name not in current_app.tasks
    assert "demoapp.scan" in current_app.tasks


def test_recoverable_tasks_lists_only_marked_tasks() -> None:
    found = recoverable_tasks()
    assert DEMO_POLICIES.items() <= found.items()
    assert all(policy_for(name) == policy for name, policy in found.items())
    assert "demoapp.scan" not in found
    assert not any(name.startswith("celery.") for name in found)


def test_lookups_use_the_app_they_are_given(fresh_app: Celery) -> None:
    name = unique()
    recoverable(group="own")(fresh_app.task(name=name, shared=False)(noop()))
    assert recoverable_tasks(fresh_app)[name] == RecoveryPolicy(group="own")
    assert name not in recoverable_tasks()
    assert policy_for(name, fresh_app) == RecoveryPolicy(group="own")
    assert name in fresh_app.tasks
    assert policy_for(name) is None
    assert name not in current_app.tasks


@pytest.mark.parametrize("bind", [False, True])
def test_shared_task_copied_onto_another_app_keeps_its_policy(
    project_names: list[str], fresh_app: Celery, bind: bool
) -> None:
    name = unique()
    project_names.append(name)
    recoverable(max_attempts=4)(shared_task(name=name, bind=bind)(bound_noop() if bind else noop()))
    copy = fresh_app.tasks[name]
    assert copy is not project_app.tasks[name]
    assert policy_of(copy) == RecoveryPolicy(max_attempts=4)
    assert recoverable_tasks(fresh_app)[name] == RecoveryPolicy(max_attempts=4)


def test_policy_of_ignores_anything_but_a_recovery_policy(fresh_app: Celery) -> None:
    task = fresh_app.task(name=unique(), shared=False)(noop())
    fresh_app.finalize()
    setattr(task, POLICY_ATTR, {"group": "forged"})
    assert policy_of(task) is None
    assert policy_of(noop()) is None
    assert policy_of(None) is None


# --- a project whose tasks live outside INSTALLED_APPS --------------------------------------------

MINIMAL_PROJECT = Path(__file__).parent / "minimal_project"
PROJECT_TASKS = {
    "proj.slow": "app.autodiscover_tasks(['proj'])",
    "proj.imported": "the imports setting",
    "proj.included": "the include setting",
}


def run_in_minimal_project(
    tmp_path: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``manage.py *args`` in a copy of tests/minimal_project, on the test database and Redis."""
    shutil.copytree(MINIMAL_PROJECT, tmp_path / "project")
    result = subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=tmp_path / "project",
        env={
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "proj.settings",
            "DATABASE_URL": database_url(),
            "PYTHONPATH": str(tmp_path / "project"),
            **(env or {}),
        },
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return result


@pytest.mark.django_db(transaction=True)
def test_the_command_knows_tasks_from_a_project_package_and_the_imports_and_include_settings(
    tmp_path: Path, redis_client: object
) -> None:
    ids = {factories.orphan(name, ()): name for name in PROJECT_TASKS}

    # The entries were sealed here, with the test project's key: the minimal project opens them with it.
    key = {"CELERY_ORPHANS_SIGNING_KEY": django_settings.SECRET_KEY}
    out = run_in_minimal_project(
        tmp_path, "reconcile_orphan_tasks", "--dry-run", "--json", "--grace-minutes", "0", env=key
    )

    assert out.returncode == 0, out.stderr
    outcomes = {o["task_id"]: o for o in map(json.loads, out.stdout.splitlines())}
    for task_id, name in ids.items():
        assert outcomes[task_id]["reason"] == "recoverable", f"{name}, found by {PROJECT_TASKS[name]}"
        assert outcomes[task_id]["action"] == "recover"


def test_the_checks_see_a_task_that_only_the_imports_setting_names(tmp_path: Path) -> None:
    out = run_in_minimal_project(
        tmp_path, "check", "--tag", "celery_orphans", env={"PROJ_MORE_IMPORTS": "proj.careless"}
    )

    assert out.returncode == 1
    assert "celery_orphans.E004" in out.stderr and "'proj.careless'" in out.stderr
