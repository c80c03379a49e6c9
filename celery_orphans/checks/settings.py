"""Checks of celery-orphans' own settings and of the database that holds the sweep lock: E006-E009,
E011, W002, W005, I001.

They read configuration only: none opens a Redis or database connection.
"""

from __future__ import annotations

from typing import Any

from celery import current_app
from django.core import checks
from django.core.exceptions import ImproperlyConfigured

from celery_orphans.checks.celery_app import visibility_timeout
from celery_orphans.checks.message import message
from celery_orphans.conf import FORFEIT_LATENCY_SECONDS, settings
from celery_orphans.store import refuse_unusable


def _setting_errors() -> dict[str, checks.CheckMessage]:
    """E007 for each celery-orphans setting whose value cannot be read, by setting name."""
    found: dict[str, checks.CheckMessage] = {}
    for setting in settings.all():
        try:
            setting.read()
        except ImproperlyConfigured as exc:
            found[setting.name] = message(
                "E007",
                str(exc),
                f"Fix {setting.django_name} in Django settings (or in the environment, without the setting).",
            )
    return found


def _redis_url_errors() -> list[checks.CheckMessage]:
    """E006: without a Redis broker, celery-orphans needs a Redis URL of its own, which a client must be
    able to use; a sentinel:// one needs its sentinels' addresses and its master's name."""
    hint = (
        "Set CELERY_ORPHANS_REDIS_URL (Django setting or environment variable) to a URL of a Redis or "
        "Valkey server: redis://[:password@]host:port/db, or rediss:// for TLS."
    )
    try:
        url = settings.redis_url()
        if url.startswith("sentinel://"):
            hint = (
                "Write it as sentinel://[:password@]host:port[/db];sentinel://host:port... and set "
                "CELERY_ORPHANS_REDIS_SENTINEL_MASTER."
            )
        refuse_unusable(url)  # says what is wrong without the URL, which may hold a password
        if url.startswith("sentinel://"):
            settings.sentinel_master()
    except ImproperlyConfigured as exc:
        return [message("E006", str(exc), hint)]
    return []


def _lease_errors(lease: float, heartbeat: float, skew: float) -> list[checks.CheckMessage]:
    """E008: a worker gives its executions up a margin (a heartbeat, the clock skew, the forfeit's latency)
    before its lease may lapse; what is left must span two renewals, or a busy live worker forfeits."""
    least = 3 * heartbeat + skew + FORFEIT_LATENCY_SECONDS
    if lease >= least:
        return []
    return [
        message(
            "E008",
            f"CELERY_ORPHANS_LEASE_SECONDS ({lease:g}) is less than 3 x CELERY_ORPHANS_HEARTBEAT_SECONDS "
            f"({heartbeat:g}) + CELERY_ORPHANS_CLOCK_SKEW_SECONDS ({skew:g}) + {FORFEIT_LATENCY_SECONDS:g}: "
            "a worker gives its tasks up a heartbeat, the clock skew and a tenth of a second before its "
            "lease may lapse, and a live worker that missed one renewal would give its tasks up.",
            f"Set CELERY_ORPHANS_LEASE_SECONDS to at least {least:g}, or lower the heartbeat.",
        )
    ]


def _stall_errors(stall: float, inspect_timeout: float) -> list[checks.CheckMessage]:
    """E009: a sweep waits out the broadcast's replies inside its transaction, which must not be ended."""
    if stall > inspect_timeout:
        return []
    return [
        message(
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
        message(
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
    if not bad.keys() & {"LEASE_SECONDS", "HEARTBEAT_SECONDS", "CLOCK_SKEW_SECONDS"}:
        found += _lease_errors(
            settings.LEASE_SECONDS, settings.HEARTBEAT_SECONDS, settings.CLOCK_SKEW_SECONDS
        )
    if not bad.keys() & {"SWEEP_STALL_SECONDS", "INSPECT_TIMEOUT_SECONDS"}:
        found += _stall_errors(settings.SWEEP_STALL_SECONDS, settings.INSPECT_TIMEOUT_SECONDS)
    if "ATTEMPTS_WINDOW_SECONDS" not in bad:
        found += _window_warnings(settings.ATTEMPTS_WINDOW_SECONDS, visibility_timeout(current_app.conf))
    return found


def check_names(**kwargs: Any) -> list[checks.CheckMessage]:
    """E011 and W005: a name with the ``CELERY_ORPHANS_`` prefix that is no setting, which nothing reads.

    In Django settings it is an error: only this package reads that prefix there, and a misspelled
    ``SHADOW_MODE`` would let the sweeps act while the operator believes they only report. The
    environment is shared with everything else a host runs, so a variable there is only a warning.
    """
    where = {"E011": settings.unknown_in_settings(), "W005": settings.unknown_in_environment()}
    found = []
    for code, unknown in where.items():
        place = "Django setting" if code == "E011" else "environment variable"
        for name in unknown:
            hint = f"Did you mean {name.closest}?" if name.closest else "Remove it, or correct its name."
            found.append(
                message(
                    code,
                    f"The {place} {name.name} is not a celery-orphans setting: nothing reads it.",
                    f"{hint} The settings reference (docs/settings.md) lists every setting.",
                )
            )
    return found


def check_database(**kwargs: Any) -> list[checks.CheckMessage]:
    """I001: only PostgreSQL and MySQL/MariaDB hold the sweep lock in the database itself."""
    from django.db import connections

    from celery_orphans.sweep.lock import lock_kind

    if lock_kind() != "redis":
        return []
    return [
        message(
            "I001",
            f"The default database is {connections['default'].vendor}, not PostgreSQL or MySQL/MariaDB: the "
            "sweep lock falls back to a Redis lock with an expiry; a sweep that outlives it may overlap the "
            "next one.",
            "Nothing to do if that suits you; a PostgreSQL or MySQL/MariaDB default database holds the lock "
            "itself instead.",
        )
    ]
