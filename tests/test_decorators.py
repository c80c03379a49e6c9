from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery, Task, shared_task
from celery.worker.request import Request
from testproject.celery import app as project_app

from celery_orphans import recoverable
from celery_orphans.registry import RecoveryPolicy
from celery_orphans.worker.request import RecoverableRequestMixin
from tests.helpers import policy_for


class CustomRequest(Request):
    """A project's own Request class, which @recoverable must keep."""


def noop() -> Callable[[], None]:
    """A new function each time: @recoverable marks the function too, so tasks must not share one."""

    def run() -> None:
        pass

    return run


def unique(prefix: str) -> str:
    return f"tests.decorators.{prefix}.{uuid.uuid4().hex}"


@pytest.fixture
def project_names() -> Iterator[list[str]]:
    """Names of tasks a test registers on the test project's app, unregistered afterwards."""
    project_app.finalize(auto=True)
    names: list[str] = []
    yield names
    for name in names:
        project_app.tasks.pop(name, None)


def test_bare_above_shared_task(project_names: list[str]) -> None:
    name = unique("shared")
    project_names.append(name)

    @recoverable
    @shared_task(name=name)
    def double(x: int) -> int:
        return 2 * x

    assert policy_for(name) == RecoveryPolicy()
    assert project_app.tasks[name].acks_late is True
    assert issubclass(project_app.tasks[name].Request, RecoverableRequestMixin)
    assert double.apply(args=(21,)).get() == 42


def test_with_options_above_bound_shared_task(project_names: list[str]) -> None:
    name = unique("shared-bound")
    project_names.append(name)

    @recoverable(group="reports", max_attempts=5)
    @shared_task(bind=True, name=name)
    def own_name(self: Task[Any, Any]) -> str:
        return str(self.name)

    assert policy_for(name) == RecoveryPolicy(group="reports", max_attempts=5)
    assert own_name.apply().get() == name


@pytest.mark.parametrize("bind", [False, True])
def test_above_app_task_before_and_after_the_app_is_finalized(fresh_app: Celery, bind: bool) -> None:
    early, late = unique("early"), unique("late")

    @recoverable(max_attempts=2)
    @fresh_app.task(name=early, bind=bind, shared=False)
    def before(*args: Any) -> int:
        return len(args)

    assert not fresh_app.finalized
    fresh_app.finalize()

    @recoverable(group="g")
    @fresh_app.task(name=late, bind=bind, shared=False)
    def after(*args: Any) -> int:
        return len(args)

    assert policy_for(early, fresh_app) == RecoveryPolicy(max_attempts=2)
    assert policy_for(late, fresh_app) == RecoveryPolicy(group="g")
    for name in (early, late):
        task = fresh_app.tasks[name]
        assert task.acks_late is True
        assert issubclass(task.Request, RecoverableRequestMixin)
    # The task still runs, and a bound one still gets itself as its first argument.
    assert before.apply(args=(1, 2)).get() == (3 if bind else 2)


def test_unmarked_task_has_no_policy_and_is_left_alone(fresh_app: Celery) -> None:
    name = unique("plain")
    fresh_app.task(name=name, shared=False)(noop())
    fresh_app.finalize()
    assert policy_for(name, fresh_app) is None
    assert fresh_app.tasks[name].acks_late is False
    assert fresh_app.tasks[name].Request == Task.Request


def test_unknown_name_has_no_policy() -> None:
    assert policy_for(unique("unknown")) is None


def _acks_late_after_marking(app: Celery, **options: Any) -> Any:
    task = recoverable(app.task(name=unique("acks"), shared=False, **options)(noop()))
    app.finalize()
    return app.tasks[task.name].acks_late


@pytest.mark.parametrize(
    ("app_default", "options", "expected"),
    [
        (False, {}, True),
        (False, {"acks_late": True}, True),
        # Indistinguishable from not setting it at all: the app default.
        (False, {"acks_late": False}, True),
        (True, {}, True),
        # The author chose something other than the app default: respected (and reported by check E004).
        (True, {"acks_late": False}, False),
    ],
)
def test_acks_late_becomes_true_unless_the_author_chose_otherwise(
    fresh_app: Celery, app_default: bool, options: dict[str, Any], expected: bool
) -> None:
    fresh_app.conf.task_acks_late = app_default
    assert _acks_late_after_marking(fresh_app, **options) is expected


@pytest.mark.parametrize("request_option", [None, CustomRequest, "tests.test_decorators:CustomRequest"])
def test_request_class_gains_the_recoverable_hooks(fresh_app: Celery, request_option: object) -> None:
    options = {} if request_option is None else {"Request": request_option}
    task = recoverable(fresh_app.task(name=unique("request"), shared=False, **options)(noop()))
    fresh_app.finalize()
    request_class = fresh_app.tasks[task.name].Request
    assert isinstance(request_class, type)
    assert issubclass(request_class, RecoverableRequestMixin)
    assert issubclass(request_class, Request)
    if request_option is not None:
        assert issubclass(request_class, CustomRequest)


def test_marking_twice_keeps_one_mixin(fresh_app: Celery) -> None:
    task = recoverable(recoverable(fresh_app.task(name=unique("twice"), shared=False)(noop())))
    fresh_app.finalize()
    mro = fresh_app.tasks[task.name].Request.__mro__
    assert mro.count(RecoverableRequestMixin) == 1


def plain(x: int) -> int:
    return x


@pytest.mark.parametrize(
    "decorate",
    [
        lambda: recoverable(plain),
        lambda: recoverable(group="g")(plain),
        lambda: recoverable(object()),
        lambda: recoverable(Request),
        # Stacked in the wrong order: @recoverable sees the plain function.
        lambda: shared_task(recoverable(plain)),
    ],
)
def test_decorating_something_that_is_not_a_task_is_a_type_error(decorate: Callable[[], object]) -> None:
    with pytest.raises(TypeError, match=r"@recoverable must decorate a Celery task.*above @shared_task"):
        decorate()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_attempts": 0}, r"max_attempts=\.\.\.\) must be a positive integer, got 0"),
        ({"max_attempts": -1}, r"max_attempts=\.\.\.\) must be a positive integer, got -1"),
        ({"max_attempts": 1.5}, r"max_attempts=\.\.\.\) must be a positive integer, got 1\.5"),
        ({"max_attempts": True}, r"max_attempts=\.\.\.\) must be a positive integer, got True"),
        ({"max_attempts": "3"}, r"max_attempts=\.\.\.\) must be a positive integer, got '3'"),
        ({"group": ""}, r"group=\.\.\.\) must be a non-empty string, got ''"),
        ({"group": 5}, r"group=\.\.\.\) must be a non-empty string, got 5"),
    ],
)
def test_bad_options_are_a_type_error(options: dict[str, Any], message: str) -> None:
    with pytest.raises(TypeError, match=message):
        recoverable(**options)
