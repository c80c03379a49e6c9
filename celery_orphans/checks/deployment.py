"""Deployment checks, run by ``manage.py check --deploy`` only: W007 and W008.

Like Django's own deployment checks they judge what a development machine may leave as it is: the
Redis client's version and the strength of the key that seals ledger entries.
"""

from __future__ import annotations

import re
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from django.core import checks
from django.core.exceptions import ImproperlyConfigured

from celery_orphans.checks.message import message
from celery_orphans.conf import settings

# The first redis-py that masks the password in a connection pool's repr (CVE-2026-32597).
MASKING_REDIS_PY = (7, 4)
# Django's own rule for a SECRET_KEY (security.W009): long, and not a repeated few characters.
KEY_MIN_LENGTH = 50
KEY_MIN_UNIQUE_CHARACTERS = 5


def check_deployment(**kwargs: Any) -> list[checks.CheckMessage]:
    """W007: a Redis client that prints passwords; W008: a weak signing key."""
    return [*_redis_client_warnings(), *_signing_key_warnings()]


def _redis_client_warnings() -> list[checks.CheckMessage]:
    installed = redis_py_that_prints_passwords()
    if installed is None:
        return []
    return [
        message(
            "W007",
            f"redis-py {installed} writes the password of a connection pool into its repr "
            "(CVE-2026-32597): any log line, error report or debug page that prints a Redis client "
            "shows the ledger's and the broker's password.",
            "Install redis>=7.4, which Celery 5.7 allows (Celery 5.5 and 5.6 cap redis-py below it). "
            "Until then, keep Redis clients out of what your error reporting captures.",
        )
    ]


def redis_py_that_prints_passwords() -> str | None:
    """The installed redis-py's version if it is one that does not mask passwords, else ``None``."""
    try:
        installed = version("redis")
    except PackageNotFoundError:  # a client installed some other way: nothing to judge by
        return None
    return installed if _release(installed) < MASKING_REDIS_PY else None


def _release(text: str) -> tuple[int, ...]:
    """The leading numbers of a version string: ``7.4.0rc1`` -> ``(7, 4, 0)``."""
    return tuple(int(part) for part in re.findall(r"\d+", text.split("+")[0])[:3])


def _signing_key_warnings() -> list[checks.CheckMessage]:
    """W008 when CELERY_ORPHANS_SIGNING_KEY or one of its fallbacks is set and weak; Django's own
    security.W009 judges SECRET_KEY, which seals the entries when neither is set."""
    try:
        key, fallbacks = settings.SIGNING_KEY, settings.SIGNING_KEY_FALLBACKS
    except ImproperlyConfigured:  # E007 says so
        return []
    named = [("CELERY_ORPHANS_SIGNING_KEY", key)] if key else []
    named += [(f"CELERY_ORPHANS_SIGNING_KEY_FALLBACKS[{i}]", k) for i, k in enumerate(fallbacks)]
    return [
        message(
            "W008",
            f"{name} has fewer than {KEY_MIN_LENGTH} characters or fewer than "
            f"{KEY_MIN_UNIQUE_CHARACTERS} distinct ones: whoever may write to the ledger's Redis could "
            "guess it and forge entries that workers' sweeps would act on.",
            "Generate a long random key, for example with django.core.management.utils."
            "get_random_secret_key(), and keep the old one in CELERY_ORPHANS_SIGNING_KEY_FALLBACKS "
            "while the entries it sealed drain.",
        )
        for name, value in named
        if len(value) < KEY_MIN_LENGTH or len(set(value)) < KEY_MIN_UNIQUE_CHARACTERS
    ]
