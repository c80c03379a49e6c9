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
    if policy is None:
        # A shared task registered on a second app is a separate object built from the same function.
        policy = getattr(getattr(task, "__wrapped__", None), POLICY_ATTR, None)
    return policy if isinstance(policy, RecoveryPolicy) else None


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
