"""Django system checks for the Celery and celery-orphans configuration that recovery depends on.

They read configuration only (the Celery app's ``conf`` and task registry, our settings, the database
vendor): none opens a broker, result-backend or Redis connection. Each has a stable ID
(docs/checks.md): ``celery_app`` checks the Celery app and its tasks, ``settings`` ours, and
``serializers`` (E012, W006) what the recoverable tasks' messages may carry, and ``deployment`` (W007,
W008, with ``--deploy`` only) the Redis client and the signing key.
"""

from __future__ import annotations

from django.core import checks

from celery_orphans.checks.celery_app import check_celery, check_pool, check_tasks
from celery_orphans.checks.deployment import check_deployment
from celery_orphans.checks.message import TAG
from celery_orphans.checks.settings import check_database, check_names, check_settings
from celery_orphans.serializers import check_serializers

__all__ = [
    "TAG",
    "check_celery",
    "check_database",
    "check_deployment",
    "check_names",
    "check_pool",
    "check_serializers",
    "check_settings",
    "check_tasks",
    "register",
]


def register() -> None:
    for check in (
        check_celery,
        check_tasks,
        check_settings,
        check_names,
        check_database,
        check_serializers,
        check_pool,
    ):
        checks.register(check, TAG)
    checks.register(check_deployment, TAG, deploy=True)
