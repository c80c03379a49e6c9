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
    """Import the task modules of every installed app once per process, as a worker does at boot.

    A web process (the management command, the admin) has not imported them, and a task it has not
    imported would look unknown.
    """
    app = app or current_app
    if id(app) not in _loaded:
        app.autodiscover_tasks(force=True)
        _loaded.add(id(app))


def policy_for(name: str, app: Celery | None = None) -> RecoveryPolicy | None:
    """The policy of the task registered under ``name``; ``None`` if unknown or not recoverable."""
    task = (app or current_app).tasks.get(name)
    return None if task is None else policy_of(task)


def is_registered(name: str, app: Celery | None = None) -> bool:
    return name in (app or current_app).tasks


def recoverable_tasks(app: Celery | None = None) -> dict[str, RecoveryPolicy]:
    """Every recoverable task of the app, by name."""
    found: dict[str, RecoveryPolicy] = {}
    for name, task in (app or current_app).tasks.items():
        policy = policy_of(task)
        if policy is not None:
            found[name] = policy
    return found
