"""Django system checks for the Celery and celery-orphans configuration that recovery depends on.

They read configuration only (the Celery app's ``conf`` and task registry, our settings, the database
vendor): none opens a broker, result-backend or Redis connection.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from celery import Task, current_app
from django.core import checks
from django.core.exceptions import ImproperlyConfigured

from celery_orphans.conf import settings
from celery_orphans.recommended import DEFAULT_VISIBILITY_TIMEOUT, recommended_celery_settings
from celery_orphans.registry import load_tasks, recoverable_tasks
from celery_orphans.store import SentinelTarget

TAG = "celery_orphans"

_LEVELS: dict[str, type[checks.Error | checks.Warning | checks.Info]] = {
    "E": checks.Error,
    "W": checks.Warning,
    "I": checks.Info,
}
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


def register() -> None:
    for check in (check_celery, check_tasks, check_settings, check_database):
        checks.register(check, TAG)


def _message(code: str, msg: str, hint: str, obj: object = None) -> checks.CheckMessage:
    """A message whose level follows the letter of its ID: E, W or I."""
    return _LEVELS[code[0]](msg, hint=hint, obj=obj, id=f"celery_orphans.{code}")


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


def _visibility_timeout(conf: Any) -> float | None:
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
        _message(
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
        _message(
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
        _message(code, f"Recoverable task {name!r} has {attr}={bad!r}: {why}.", hint, obj=name)
        for attr, (code, bad, why, hint) in _TASK_RULES.items()
        if bool(getattr(task, attr)) is bad
    ]
    if visibility is not None and time_limit and time_limit >= visibility:
        found.append(
            _message(
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
    visibility = _visibility_timeout(conf)
    found: list[checks.CheckMessage] = []
    for name in recoverable_tasks(current_app):
        task = current_app.tasks[name]
        found += _task_messages(name, task, task.time_limit or conf.task_time_limit, visibility)
    return found


def _setting_errors() -> dict[str, checks.CheckMessage]:
    """E007 for each celery-orphans setting whose value cannot be read, by setting name."""
    found: dict[str, checks.CheckMessage] = {}
    for setting in settings.all():
        try:
            setting.read()
        except ImproperlyConfigured as exc:
            found[setting.name] = _message(
                "E007",
                str(exc),
                f"Fix {setting.django_name} in Django settings (or in the environment, without the setting).",
            )
    return found


def _redis_url_errors() -> list[checks.CheckMessage]:
    """E006: without a Redis broker, celery-orphans needs a Redis URL of its own; a sentinel:// one needs
    its sentinels' addresses and its master's name."""
    hint = "Set CELERY_ORPHANS_REDIS_URL (Django setting or environment variable) to a redis:// URL."
    try:
        url = settings.redis_url()
        if url.startswith("sentinel://"):
            hint = (
                "Write it as sentinel://[:password@]host:port[/db];sentinel://host:port... and set "
                "CELERY_ORPHANS_REDIS_SENTINEL_MASTER."
            )
            SentinelTarget.from_url(url)
            settings.sentinel_master()
    except ImproperlyConfigured as exc:
        return [_message("E006", str(exc), hint)]
    except ValueError as exc:  # the URL is not shown: it may hold a password
        return [_message("E006", f"CELERY_ORPHANS_REDIS_URL is not a valid sentinel URL: {exc}.", hint)]
    return []


def _lease_errors(lease: float, heartbeat: float) -> list[checks.CheckMessage]:
    """E008: a lease must survive a couple of missed heartbeats, or a busy live worker looks dead."""
    if lease >= 3 * heartbeat:
        return []
    return [
        _message(
            "E008",
            f"CELERY_ORPHANS_LEASE_SECONDS ({lease:g}) is less than 3 x CELERY_ORPHANS_HEARTBEAT_SECONDS "
            f"({heartbeat:g}): a live worker that misses two heartbeats would be taken for dead.",
            f"Set CELERY_ORPHANS_LEASE_SECONDS to at least {3 * heartbeat:g}, or lower the heartbeat.",
        )
    ]


def _stall_errors(stall: float, inspect_timeout: float) -> list[checks.CheckMessage]:
    """E009: a sweep waits out the broadcast's replies inside its transaction, which must not be ended."""
    if stall > inspect_timeout:
        return []
    return [
        _message(
            "E009",
            f"CELERY_ORPHANS_SWEEP_STALL_SECONDS ({stall:g}) is not above "
            f"CELERY_ORPHANS_INSPECT_TIMEOUT_SECONDS ({inspect_timeout:g}): a sweep waits for the workers' "
            "replies inside its transaction, which the database would end whenever a worker is silent.",
            "Keep CELERY_ORPHANS_SWEEP_STALL_SECONDS well above the inspect timeout (60 by default).",
        )
    ]


def _window_warnings(window: float, visibility: float | None) -> list[checks.CheckMessage]:
    """W002: the fence against a stale copy must outlive the broker's restore of that copy."""
    if visibility is None or window >= visibility:
        return []
    return [
        _message(
            "W002",
            f"CELERY_ORPHANS_ATTEMPTS_WINDOW_SECONDS ({window:g}) is shorter than the Redis "
            f"visibility_timeout ({visibility:g}): the fence expires before the broker restores a recovered "
            "task's stale copy, which would then run again.",
            f"Set CELERY_ORPHANS_ATTEMPTS_WINDOW_SECONDS to at least {visibility:g}.",
        )
    ]


def check_settings(**kwargs: Any) -> list[checks.CheckMessage]:
    """E006, E007, E008, E009 and W002: the ``CELERY_ORPHANS_*`` settings."""
    bad = _setting_errors()
    found = list(bad.values())
    # The checks below read settings again: skip those whose inputs were just reported.
    if "REDIS_URL" not in bad:
        found += _redis_url_errors()
    if not bad.keys() & {"LEASE_SECONDS", "HEARTBEAT_SECONDS"}:
        found += _lease_errors(settings.LEASE_SECONDS, settings.HEARTBEAT_SECONDS)
    if not bad.keys() & {"SWEEP_STALL_SECONDS", "INSPECT_TIMEOUT_SECONDS"}:
        found += _stall_errors(settings.SWEEP_STALL_SECONDS, settings.INSPECT_TIMEOUT_SECONDS)
    if "ATTEMPTS_WINDOW_SECONDS" not in bad:
        found += _window_warnings(settings.ATTEMPTS_WINDOW_SECONDS, _visibility_timeout(current_app.conf))
    return found


def check_database(**kwargs: Any) -> list[checks.CheckMessage]:
    """I001: only PostgreSQL and MySQL/MariaDB hold the sweep lock in the database itself."""
    from django.db import connections

    from celery_orphans.sweep.lock import lock_kind

    if lock_kind() != "redis":
        return []
    return [
        _message(
            "I001",
            f"The default database is {connections['default'].vendor}, not PostgreSQL or MySQL/MariaDB: the "
            "sweep lock falls back to a Redis lock with an expiry; a sweep that outlives it may overlap the "
            "next one.",
            "Nothing to do if that suits you; a PostgreSQL or MySQL/MariaDB default database holds the lock "
            "itself instead.",
        )
    ]
