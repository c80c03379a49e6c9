"""Settings for celery-orphans, read lazily on every access.

Each setting ``NAME`` is looked up as the Django setting ``CELERY_ORPHANS_NAME``, then the environment
variable of the same name, then the documented default. Nothing is cached, so ``override_settings`` and
pytest-django's ``settings`` fixture take effect at once, and nothing is ever written back into
``django.conf.settings``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, overload

from django.conf import settings as django_settings
from django.core.exceptions import ImproperlyConfigured

PREFIX = "CELERY_ORPHANS_"
# URL schemes of a Redis or Valkey the ledger can use; sentinel:// lists the sentinels of one master.
REDIS_SCHEMES = frozenset({"redis", "rediss", "valkey", "valkeys", "sentinel"})
T = TypeVar("T")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _invalid(name: str, value: object, expected: str) -> ImproperlyConfigured:
    return ImproperlyConfigured(f"{PREFIX}{name} must be {expected}, got {value!r}.")


def _bool(name: str, value: object) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise _invalid(name, value, "a boolean (true/false)")


def _number(name: str, value: object, *, minimum: float, integer: bool) -> Any:
    if isinstance(value, bool):
        raise _invalid(name, value, "a number")
    try:
        number = int(value) if integer else float(value)  # type: ignore[arg-type,call-overload]
    except (TypeError, ValueError):
        raise _invalid(name, value, "an integer" if integer else "a number") from None
    if not math.isfinite(number):
        raise _invalid(name, value, "a finite number")
    if integer and isinstance(value, float) and not value.is_integer():
        raise _invalid(name, value, "an integer")
    if number < minimum:
        raise _invalid(name, value, f"at least {minimum:g}")
    return number


def positive_int(name: str, value: object) -> int:
    return int(_number(name, value, minimum=1, integer=True))


def non_negative_int(name: str, value: object) -> int:
    return int(_number(name, value, minimum=0, integer=True))


def non_negative_float(name: str, value: object) -> float:
    return float(_number(name, value, minimum=0, integer=False))


def positive_float(name: str, value: object) -> float:
    number = float(_number(name, value, minimum=0, integer=False))
    if number == 0:
        raise _invalid(name, value, "greater than 0")
    return number


def _optional_positive_int(name: str, value: object) -> int | None:
    if value is None or (isinstance(value, str) and value.strip().lower() in {"", "none"}):
        return None
    return positive_int(name, value)


def _optional_str(name: str, value: object) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise _invalid(name, value, "a string")
    return value


def _key_prefix(name: str, value: object) -> str:
    if not isinstance(value, str) or not value or any(c.isspace() for c in value):
        raise _invalid(name, value, "a non-empty string without spaces")
    return value


def _groups(name: str, value: object) -> dict[str, bool]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise _invalid(name, value, 'a JSON object such as {"summaries": true}') from None
    if not isinstance(value, Mapping):
        raise _invalid(name, value, "a mapping of group name to boolean")
    return {str(group): _bool(f"{name}[{group!r}]", switch) for group, switch in value.items()}


@dataclass(frozen=True)
class Setting(Generic[T]):
    """One setting: its name without prefix, how to parse it, its default."""

    name: str
    parse: Callable[[str, object], T]
    default: T
    doc: str

    @property
    def django_name(self) -> str:
        return PREFIX + self.name

    def read(self) -> T:
        value = getattr(django_settings, self.django_name, _MISSING)
        if value is _MISSING:
            value = os.environ.get(self.django_name, _MISSING)
        if value is _MISSING:
            return self.default
        return self.parse(self.name, value)

    @overload
    def __get__(self, instance: None, owner: type) -> Setting[T]: ...
    @overload
    def __get__(self, instance: object, owner: type) -> T: ...
    def __get__(self, instance: object | None, owner: type) -> T | Setting[T]:
        return self if instance is None else self.read()


_MISSING: Any = object()


class Settings:
    """Typed access to every celery-orphans setting; see docs/settings.md."""

    ENABLED = Setting("ENABLED", _bool, False, "Master switch for the reconcile sweep.")
    GRACE_SECONDS = Setting(
        "GRACE_SECONDS",
        non_negative_float,
        5.0,
        "A task younger than this (from date_started) is never judged orphaned.",
    )
    MAX_ATTEMPTS = Setting(
        "MAX_ATTEMPTS",
        positive_int,
        3,
        "Recoveries allowed per task id within the attempts window before it is marked terminal.",
    )
    ATTEMPTS_WINDOW_SECONDS = Setting(
        "ATTEMPTS_WINDOW_SECONDS",
        positive_int,
        86_400,
        "How long the recovery counter (and the fence against stale copies) is kept per task id.",
    )
    REDIS_URL = Setting(
        "REDIS_URL",
        _optional_str,
        None,
        "Redis/Valkey for the ledger, leases and counters (redis://, rediss:// or sentinel://); defaults "
        "to a Redis broker URL.",
    )
    REDIS_SENTINEL_MASTER = Setting(
        "REDIS_SENTINEL_MASTER",
        _optional_str,
        None,
        "The master's name the sentinels of a sentinel:// REDIS_URL watch; defaults to the broker's "
        "transport option master_name.",
    )
    GROUPS: Setting[dict[str, bool]] = Setting(
        "GROUPS", _groups, {}, "Per-group switches; a group not listed is on."
    )
    SWEEP_INTERVAL_SECONDS = Setting(
        "SWEEP_INTERVAL_SECONDS", positive_int, 5, "How often Beat runs the reconcile task."
    )
    HEARTBEAT_SECONDS = Setting(
        "HEARTBEAT_SECONDS", positive_float, 2.0, "How often each worker renews its lease."
    )
    LEASE_SECONDS = Setting(
        "LEASE_SECONDS", positive_float, 10.0, "How long a worker lease lives without renewal."
    )
    INSPECT_TIMEOUT_SECONDS = Setting(
        "INSPECT_TIMEOUT_SECONDS",
        positive_float,
        1.0,
        "How long each worker has, from the moment the sweep's one query_task broadcast is sent, to "
        "answer it; the wait ends sooner once every worker asked has answered.",
    )
    SWEEP_STALL_SECONDS = Setting(
        "SWEEP_STALL_SECONDS",
        positive_float,
        60.0,
        "On PostgreSQL and MySQL/MariaDB, how long a sweep may wait for a row lock, or leave its "
        "transaction idle, before the database gives up the wait or ends the transaction and with it the "
        "sweep lock.",
    )
    BOOT_SWEEP = Setting(
        "BOOT_SWEEP",
        _bool,
        True,
        "When a worker boots, recover at once what an earlier boot of its node name left running.",
    )
    WATCH = Setting(
        "WATCH",
        _bool,
        True,
        "Let each worker sweep at once when its heartbeat sees another boot's lease lapse, or the "
        "process of a boot on its machine exit, instead of waiting for Beat's next sweep.",
    )
    SHADOW_MODE = Setting(
        "SHADOW_MODE",
        _bool,
        False,
        "Decide and audit what would be done, without doing it: watch before switching recovery on.",
    )
    MAX_ORPHAN_AGE_SECONDS: Setting[int | None] = Setting(
        "MAX_ORPHAN_AGE_SECONDS",
        _optional_positive_int,
        86_400,
        "An orphan that started longer ago than this is marked terminal, not resurrected; None: no limit.",
    )
    MAX_RECOVERIES_PER_SWEEP: Setting[int | None] = Setting(
        "MAX_RECOVERIES_PER_SWEEP",
        _optional_positive_int,
        100,
        "Recover at most this many per sweep, oldest first; the rest wait for the next. None: no limit.",
    )
    KEY_PREFIX = Setting("KEY_PREFIX", _key_prefix, "celery_orphans", "Prefix of every Redis key.")
    CHECKPOINT_TTL_SECONDS = Setting(
        "CHECKPOINT_TTL_SECONDS",
        positive_int,
        604_800,
        "How long a task's checkpoint is kept after its last save, so an abandoned one goes away.",
    )
    CHECKPOINT_MAX_BYTES = Setting(
        "CHECKPOINT_MAX_BYTES",
        positive_int,
        65_536,
        "Largest checkpoint, in bytes of JSON, that Checkpoint.save() accepts.",
    )

    def all(self) -> tuple[Setting[Any], ...]:
        return tuple(v for v in vars(type(self)).values() if isinstance(v, Setting))

    def redis_url(self) -> str:
        """The Redis URL to use, falling back to the Celery broker URL when that is Redis."""
        url = self.REDIS_URL
        if url:
            return url
        broker = _celery_broker_url()
        if broker and broker.split("://", 1)[0] in REDIS_SCHEMES:
            return broker
        raise ImproperlyConfigured(
            f"{PREFIX}REDIS_URL is not set and the Celery broker is not Redis; "
            "celery-orphans needs Redis or Valkey for its ledger, leases and counters."
        )

    def sentinel_master(self) -> str:
        """The master's name for a ``sentinel://`` Redis URL: the setting, else the broker's own."""
        name = self.REDIS_SENTINEL_MASTER or _celery_transport_option("master_name")
        if not name:
            raise ImproperlyConfigured(
                f"{PREFIX}REDIS_URL is a sentinel:// URL but no master name is set: set "
                f"{PREFIX}REDIS_SENTINEL_MASTER (or the broker's transport option master_name)."
            )
        return str(name)


def _celery_broker_url() -> str | None:
    from celery import current_app

    url = current_app.conf.broker_url
    if isinstance(url, (list, tuple)):
        url = ";".join(url)
    if not url:
        return None
    url = str(url).strip()
    if url.startswith("sentinel://"):
        return url  # every sentinel of the list
    # kombu accepts a failover list "redis://a;redis://b": the first is the primary.
    return url.split(";", 1)[0].strip()


def _celery_transport_option(name: str) -> object:
    from celery import current_app

    return (current_app.conf.broker_transport_options or {}).get(name)


settings = Settings()
