"""Checks of the Celery app's configuration and of its recoverable tasks: E001-E004, W001, W003, E013.

They read configuration only (the Celery app's ``conf`` and task registry): none opens a broker or
result-backend connection.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from celery import Task, current_app
from django.core import checks

from celery_orphans.checks.message import message
from celery_orphans.recommended import DEFAULT_VISIBILITY_TIMEOUT, recommended_celery_settings
from celery_orphans.registry import load_tasks, recoverable_tasks
from celery_orphans.worker import handover

# Transports that keep unacknowledged messages in Redis and restore them after ``visibility_timeout``.
_REDIS_TRANSPORTS = frozenset({"redis", "rediss", "sentinel"})

_SOFT_SHUTDOWN_SIGNALS = (
    " Stop workers with SIGQUIT, or SIGTERM with REMAP_SIGTERM=SIGQUIT in their environment: the soft "
    "shutdown applies to a cold shutdown only."
)
# Celery setting -> (check ID, acceptable value?, why recovery needs it).
_CONF_RULES: dict[str, tuple[str, Callable[[Any], bool], str]] = {
    "task_track_started": ("E002", bool, "no STARTED row is written, so an orphan leaves nothing to find"),
    "result_extended": ("E003", bool, "result rows lack the task name, arguments and worker"),
    "task_reject_on_worker_lost": (
        "W003",
        bool,
        "a task whose pool child dies (say, an OOM kill) is acknowledged as FAILURE instead of re-queued",
    ),
    "worker_prefetch_multiplier": (
        "W003",
        lambda value: value == 1,
        "a dying worker takes prefetched, never-started messages with it, which have no STARTED row",
    ),
    "worker_deduplicate_successful_tasks": (
        "W003",
        bool,
        "a recovered task's original message, restored by the broker later, runs again after the re-run",
    ),
    "worker_soft_shutdown_timeout": (
        "W003",
        lambda value: bool(value) and value > 0,
        "a stopping worker cancels its running tasks at once (SIGQUIT) or waits for them with no limit "
        "(SIGTERM) until a SIGKILL orphans them",
    ),
}
# Task attribute -> (check ID, value that breaks or weakens recovery, why, what to change).
_TASK_RULES: dict[str, tuple[str, bool, str, str]] = {
    "acks_late": (
        "E004",
        False,
        "the broker forgets its message once it starts, so a worker death loses it",
        "Remove acks_late=False from the task's decorator (@recoverable then sets acks_late=True).",
    ),
    "ignore_result": (
        "W004",
        True,
        "no result row is written for it, so its orphans are found through the ledger alone and a task "
        "marked terminal has no row to show it",
        "Nothing to change if nobody reads its result; without ignore_result=True its STARTED row and "
        "its outcome are visible to people and scripts as well.",
    ),
}


def _scheme(url: str) -> str:
    """``redis`` of ``redis://h/0``, ``db`` of ``db+postgresql://h/db``: the part Celery and kombu resolve."""
    return url.split("://", 1)[0].split("+", 1)[0]


def _broker_transport(conf: Any) -> str:
    url = conf.broker_url
    if isinstance(url, (list, tuple)):
        url = url[0] if url else None
    if isinstance(url, str) and "://" in url:
        return _scheme(url.split(";", 1)[0])
    return str(conf.broker_transport or "amqp")


def visibility_timeout(conf: Any) -> float | None:
    """When a Redis broker restores an unacknowledged message; ``None`` for brokers that do not."""
    if _broker_transport(conf) not in _REDIS_TRANSPORTS:
        return None
    options = conf.broker_transport_options or {}
    return float(options.get("visibility_timeout", DEFAULT_VISIBILITY_TIMEOUT))


def _shown(value: Any) -> Any:
    """A URL as it may be printed: its password masked."""
    from kombu.utils.url import maybe_sanitize_url

    return maybe_sanitize_url(value) if isinstance(value, str) else value


def _backend_errors(backend: Any) -> list[checks.CheckMessage]:
    """E001: orphans are found by their STARTED rows in django-celery-results' table."""
    from celery.app.backends import by_name
    from celery.exceptions import ImproperlyConfigured as CeleryImproperlyConfigured
    from django_celery_results.backends import DatabaseBackend

    name = _scheme(backend) if isinstance(backend, str) and "://" in backend else backend
    try:
        cls: object = by_name(name, current_app.loader)
    except (CeleryImproperlyConfigured, ImportError, AttributeError) as exc:
        problem = f"cannot be loaded ({exc})"
    else:
        if isinstance(cls, type) and issubclass(cls, DatabaseBackend):
            return []
        problem = "is not django-celery-results' database backend"
    return [
        message(
            "E001",
            f"Celery result_backend {_shown(backend)!r} {problem}; orphans are found by their STARTED rows "
            "there.",
            'Set result_backend = "django-db" (CELERY_RESULT_BACKEND in Django settings) and add '
            '"django_celery_results" to INSTALLED_APPS.',
        )
    ]


def _conf_messages(conf: Any) -> list[checks.CheckMessage]:
    """E002, E003 and W003: Celery settings recovery needs, or that make it work better."""
    recommended = recommended_celery_settings()
    return [
        message(
            code,
            f"Celery setting {key} is {getattr(conf, key)!r}: {why}.",
            f"Set {key} = {recommended[key]!r} (CELERY_{key.upper()} in Django settings with the CELERY "
            "namespace); recommended_celery_settings() holds every recommended value."
            + (_SOFT_SHUTDOWN_SIGNALS if key == "worker_soft_shutdown_timeout" else ""),
        )
        for key, (code, ok, why) in _CONF_RULES.items()
        if not ok(getattr(conf, key))
    ]


def check_celery(**kwargs: Any) -> list[checks.CheckMessage]:
    """E001, E002, E003 and W003: the Celery app's own configuration."""
    conf = current_app.conf
    return [*_backend_errors(conf.result_backend), *_conf_messages(conf)]


def _task_messages(
    name: str, task: Task[Any, Any], time_limit: float | None, visibility: float | None
) -> list[checks.CheckMessage]:
    """E004, W004 and W001 for one recoverable task, given its effective hard time limit."""
    found = [
        message(code, f"Recoverable task {name!r} has {attr}={bad!r}: {why}.", hint, obj=name)
        for attr, (code, bad, why, hint) in _TASK_RULES.items()
        if bool(getattr(task, attr)) is bad
    ]
    if visibility is not None and time_limit and time_limit >= visibility:
        found.append(
            message(
                "W001",
                f"Recoverable task {name!r} may run {time_limit:g}s, not less than the Redis "
                f"visibility_timeout ({visibility:g}s): the broker will deliver it again while it runs.",
                "Raise broker_transport_options['visibility_timeout'] above the task's time limit "
                "(recommended_celery_settings(visibility_timeout=...)), or lower the time limit.",
                obj=name,
            )
        )
    return found


def check_tasks(**kwargs: Any) -> list[checks.CheckMessage]:
    """E004, W004 and W001: every task marked ``@recoverable``."""
    # ``manage.py check`` never imports task modules and a worker runs the checks before it does:
    # import them as a worker would, or no task would be checked.
    load_tasks(current_app)
    conf = current_app.conf
    visibility = visibility_timeout(conf)
    found: list[checks.CheckMessage] = []
    for name in recoverable_tasks(current_app):
        task = current_app.tasks[name]
        found += _task_messages(name, task, task.time_limit or conf.task_time_limit, visibility)
    return found


def check_pool(**kwargs: Any) -> list[checks.CheckMessage]:
    """E013: a platform and pool whose processes cannot read their worker's validity (``handover.py``)."""
    conf = current_app.conf
    if str(conf.get("worker_pool") or "prefork") not in ("prefork", "processes"):
        return []
    why = handover.unsupported(str(conf.get("worker_pool_start_method") or "fork"), _broker_transport(conf))
    if why is None:
        return []
    hint = (
        "Use worker_pool_start_method = 'fork' on Linux, or a broker whose transport has an event loop "
        "(Redis, RabbitMQ), or another pool (worker_pool = 'threads'); silence the check for workers "
        "started with -P other than prefork."
    )
    return [message("E013", f"celery-orphans cannot protect this worker's tasks: {why}.", hint)]
