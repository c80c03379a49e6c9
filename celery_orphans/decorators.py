"""The ``@recoverable`` decorator."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, overload

from celery import Task, _state
from celery.local import PromiseProxy, Proxy
from celery.utils.imports import symbol_by_name

from celery_orphans.registry import POLICY_ATTR, RecoveryPolicy
from celery_orphans.worker import forfeit
from celery_orphans.worker.request import recoverable_request_class

TaskT = TypeVar("TaskT")


@overload
def recoverable(task: TaskT, /) -> TaskT: ...
@overload
def recoverable(*, group: str | None = None, max_attempts: int | None = None) -> Callable[[TaskT], TaskT]: ...
def recoverable(task: Any = None, /, *, group: str | None = None, max_attempts: int | None = None) -> Any:
    """Mark a Celery task as idempotent, so an orphaned run of it may be sent again.

    Stack it above ``@shared_task`` or ``@app.task``, bare or with options::

        @recoverable(group="summaries", max_attempts=5)
        @shared_task
        def summarize(day): ...

    The mark lives on the task object, so every process that loads the Celery app agrees on it.
    The task gets ``acks_late=True`` unless its author chose a value that differs from the app's default.
    """
    if group is not None and (not isinstance(group, str) or not group):
        raise TypeError(f"@recoverable(group=...) must be a non-empty string, got {group!r}.")
    if max_attempts is not None and (
        isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1
    ):
        raise TypeError(f"@recoverable(max_attempts=...) must be a positive integer, got {max_attempts!r}.")
    policy = RecoveryPolicy(group=group, max_attempts=max_attempts)
    if task is None:
        return lambda t: _mark(t, policy)
    return _mark(task, policy)


def _mark(task: Any, policy: RecoveryPolicy) -> Any:
    if isinstance(task, PromiseProxy) and not task.__evaluated__():
        # ``@app.task`` before the app is finalized: mark the task when it comes into being.
        task.__then__(lambda: _apply(_resolve(task), policy))
        return task
    target = _resolve(task)
    _apply(target, policy)
    if isinstance(task, Proxy):
        # ``@shared_task`` gives every app its own copy of the task: mark each one as it appears.
        name = target.name
        for app in _state._get_active_apps():  # type: ignore[attr-defined]
            if app.finalized:
                _apply_by_name(app, name, policy)
        _state.connect_on_app_finalize(lambda app: _apply_when_finalized(app, name, policy))
    return task


def _resolve(task: Any) -> Task[Any, Any]:
    target = task._get_current_object() if isinstance(task, Proxy) else task
    if not isinstance(target, Task):
        raise TypeError(
            f"@recoverable must decorate a Celery task (put it above @shared_task or @app.task), "
            f"got {task!r}."
        )
    return target


def _apply_when_finalized(app: Any, name: str, policy: RecoveryPolicy) -> None:
    # Finalize callbacks run in no set order: the shared task may not be on this app yet.
    _apply_by_name(app, name, policy)
    app.on_after_finalize.connect(lambda sender, **kwargs: _apply_by_name(app, name, policy), weak=False)


def _apply_by_name(app: Any, name: str, policy: RecoveryPolicy) -> None:
    task = app._tasks.get(name)
    if task is not None:
        _apply(task, policy)


def _apply(task: Task[Any, Any], policy: RecoveryPolicy) -> None:

    setattr(task, POLICY_ATTR, policy)
    app_default = bool(task.app.conf.task_acks_late)
    if task.acks_late is None or bool(task.acks_late) == app_default:
        task.acks_late = True
    task.Request = recoverable_request_class(symbol_by_name(task.Request))  # type: ignore[assignment]
    forfeit.guard_task(task)
