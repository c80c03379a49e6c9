"""Which tasks are recoverable, read from the Celery app's own task registry."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from celery import Celery, current_app

POLICY_ATTR = "__celery_orphans_policy__"


@dataclass(frozen=True)
class RecoveryPolicy:
    """How a ``@recoverable`` task may be recovered."""

    group: str | None = None
    max_attempts: int | None = None


def policy_of(task: Any) -> RecoveryPolicy | None:
    """The policy marked on a task object, or ``None`` if it is not recoverable."""
    policy = getattr(task, POLICY_ATTR, None)
    return policy if isinstance(policy, RecoveryPolicy) else None


_loaded: set[int] = set()


def load_tasks(app: Celery | None = None) -> None:
    """Import every task module a worker of ``app`` imports, once per process, the way a worker does.

    That is Celery's ``import_default_modules``: every ``app.autodiscover_tasks(...)`` call, with the
    packages it was given, and the modules the ``imports`` and ``include`` settings name. A web process
    (the management command, the admin, the checks) has imported none of them, and a task it has not
    imported would look unknown.
    """
    app = app or current_app
    if id(app) in _loaded:
        return
    # Marked first: Celery's Django fix-up answers that import by running Django's checks, among them
    # ours, which ask for the tasks again; that nested run's findings are discarded.
    _loaded.add(id(app))
    try:
        app.loader.import_default_modules()
    except BaseException:
        _loaded.discard(id(app))
        raise


def recoverable_tasks(app: Celery | None = None) -> dict[str, RecoveryPolicy]:
    """Every recoverable task of the app, by name."""
    found: dict[str, RecoveryPolicy] = {}
    for name, task in (app or current_app).tasks.items():
        policy = policy_of(task)
        if policy is not None:
            found[name] = policy
    return found
