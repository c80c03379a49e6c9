"""Settings for celery-orphans, read lazily on every access: each one declared, with its default.

Each setting ``NAME`` is looked up as the Django setting ``CELERY_ORPHANS_NAME``, then the environment
variable of the same name, then the documented default. Nothing is cached, so ``override_settings`` and
pytest-django's ``settings`` fixture take effect at once, and nothing is ever written back into
``django.conf.settings``. How one setting is read and its value checked: ``setting.py``.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from django.conf import settings as django_settings
from django.core.exceptions import ImproperlyConfigured

from celery_orphans.setting import (
    PREFIX,
    Setting,
    boolean,
    groups,
    key_prefix,
    keys,
    non_negative_float,
    optional_positive_int,
    optional_str,
    positive_float,
    positive_int,
    secret,
    token,
)

__all__ = ["FORFEIT_LATENCY_SECONDS", "PREFIX", "Setting", "Settings", "UnknownName", "settings"]

# URL schemes of a Redis or Valkey the ledger can use; sentinel:// lists the sentinels of one master.
REDIS_SCHEMES = frozenset({"redis", "rediss", "valkey", "valkeys", "sentinel"})
# How often the threads that enforce a worker's forfeit look at the clock: how late past the instant its
# executions stop holding one of them may still act.
FORFEIT_LATENCY_SECONDS = 0.1


@dataclass(frozen=True)
class UnknownName:
    """A name with the ``CELERY_ORPHANS_`` prefix that is no setting, so nothing reads it (a typo, say)."""

    name: str
    closest: str | None  # the setting it most resembles, if any does


class Settings:
    """Typed access to every celery-orphans setting; see docs/settings.md."""

    ENABLED = Setting("ENABLED", boolean, False, "Master switch for the reconcile sweep.")
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
        optional_str,
        None,
        "Redis/Valkey for the ledger, leases and counters (redis://, rediss:// or sentinel://); defaults "
        "to a Redis broker URL.",
    )
    REDIS_SENTINEL_MASTER = Setting(
        "REDIS_SENTINEL_MASTER",
        optional_str,
        None,
        "The master's name the sentinels of a sentinel:// REDIS_URL watch; defaults to the broker's "
        "transport option master_name.",
    )
    SIGNING_KEY = Setting(
        "SIGNING_KEY",
        secret,
        None,
        "Key of the tag that seals each ledger entry; None: Django's SECRET_KEY (and SECRET_KEY_FALLBACKS).",
    )
    SIGNING_KEY_FALLBACKS: Setting[list[str]] = Setting(
        "SIGNING_KEY_FALLBACKS",
        keys,
        [],
        "Earlier signing keys whose tags are still accepted while entries sealed with them drain.",
    )
    IN_FLIGHT_CACHE_SECONDS = Setting(
        "IN_FLIGHT_CACHE_SECONDS",
        non_negative_float,
        5.0,
        "How long the in-flight page's dry run is shared by every viewer before a load judges again; 0: "
        "every load judges.",
    )
    GROUPS: Setting[dict[str, bool]] = Setting(
        "GROUPS", groups, {}, "Per-group switches; a group not listed is on."
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
    CLOCK_SKEW_SECONDS = Setting(
        "CLOCK_SKEW_SECONDS",
        non_negative_float,
        0.5,
        "How far the ledger Redis's clock may run ahead of a worker's over one lease (a clock step, a "
        "failover to a replica whose clock differs): a worker gives its executions up this much sooner.",
    )
    LEDGER_HOLD_SECONDS = Setting(
        "LEDGER_HOLD_SECONDS",
        non_negative_float,
        60.0,
        "How long a worker whose ledger refuses its writes, or that holds no lease, gives a recoverable "
        "delivery back to the broker unrun instead of running it unrecorded; from its trouble's start, "
        "after which it runs such deliveries unprotected (fail open). 0: fail open at once.",
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
        boolean,
        True,
        "When a worker boots, recover at once what an earlier boot of its node name left running.",
    )
    WATCH = Setting(
        "WATCH",
        boolean,
        True,
        "Let each worker sweep at once when its heartbeat sees another boot's lease lapse, or the "
        "process of a boot on its machine exit, instead of waiting for Beat's next sweep.",
    )
    PRESENCE = Setting(
        "PRESENCE",
        boolean,
        True,
        "Let each worker hold a presence connection to the ledger's Redis, which Redis drops the moment "
        "its process dies on a live host, so that its tasks are recovered a heartbeat and a half after "
        "another worker's renewal sees it gone instead of once its lease lapses (worker/presence.py).",
    )
    PRESENCE_LOSS_PAUSES = Setting(
        "PRESENCE_LOSS_PAUSES",
        boolean,
        True,
        "Let a prefork worker pause its recoverable executions 1.5 s after its presence connection ended "
        "and was not made again, until a renewal answers that its lease holds (they go on) or its lease "
        "is given up (they are killed, and run again once elsewhere), so that a worker dead where no "
        "live worker's machine can see it is recovered a wait after its presence is seen gone (about 3 "
        "to 5 s) instead of a heartbeat before its lease's end (worker/presence_loss.py).",
    )
    SHADOW_MODE = Setting(
        "SHADOW_MODE",
        boolean,
        False,
        "Decide and audit what would be done, without doing it: watch before switching recovery on.",
    )
    MAX_ORPHAN_AGE_SECONDS: Setting[int | None] = Setting(
        "MAX_ORPHAN_AGE_SECONDS",
        optional_positive_int,
        86_400,
        "An orphan that started longer ago than this is marked terminal, not resurrected; None: no limit.",
    )
    MAX_RECOVERIES_PER_SWEEP: Setting[int | None] = Setting(
        "MAX_RECOVERIES_PER_SWEEP",
        optional_positive_int,
        100,
        "Recover at most this many per sweep, oldest first; the rest wait for the next. None: no limit.",
    )
    KEY_PREFIX = Setting("KEY_PREFIX", key_prefix, "celery_orphans", "Prefix of every Redis key.")
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

    STATUS_TOKEN: Setting[str | None] = Setting(
        "STATUS_TOKEN",
        token,
        None,
        "A bearer token that may read status/ without a user, for a load balancer or an uptime probe.",
    )

    def all(self) -> tuple[Setting[Any], ...]:
        return tuple(v for v in vars(type(self)).values() if isinstance(v, Setting))

    def unknown_in_settings(self) -> list[UnknownName]:
        """The ``CELERY_ORPHANS_*`` Django settings that name no setting: each is ignored."""
        return self._unknown(name for name in dir(django_settings) if name.startswith(PREFIX))

    def unknown_in_environment(self) -> list[UnknownName]:
        """The environment variables that begin with the prefix, in any case, and name no setting."""
        return self._unknown(name for name in os.environ if name.upper().startswith(PREFIX))

    def _unknown(self, names: Iterable[str]) -> list[UnknownName]:
        known = {setting.name for setting in self.all()}
        found = []
        for name in sorted(set(names)):
            if name.startswith(PREFIX) and name[len(PREFIX) :] in known:
                continue
            closest = _closest(name[len(PREFIX) :].upper(), known)
            found.append(UnknownName(name, PREFIX + closest if closest else None))
        return found

    def lease_margin(self) -> float:
        """How long before its lease may lapse in Redis a worker gives its executions up: a heartbeat (a
        renewal sent just before may be lost), the clock skew, and the forfeit's own latency."""
        return self.HEARTBEAT_SECONDS + self.CLOCK_SKEW_SECONDS + FORFEIT_LATENCY_SECONDS

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


def _closest(typed: str, known: set[str]) -> str | None:
    """The setting ``typed`` most resembles: a close spelling, else the one setting it begins
    (``GRACE`` for ``GRACE_SECONDS``)."""
    close = difflib.get_close_matches(typed, sorted(known), n=1, cutoff=0.6)
    if close:
        return close[0]
    begun = [name for name in known if typed and name.startswith(typed)]
    return begun[0] if len(begun) == 1 else None


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
