"""The Redis/Valkey connection and the names of every key celery-orphans writes."""

from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

import redis
from django.core.exceptions import ImproperlyConfigured
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.exceptions import ConnectionError, TimeoutError
from redis.retry import Retry
from redis.sentinel import Sentinel

from celery_orphans.conf import PREFIX, settings

# The schemes the ledger's client takes, and what redis-py calls them: Valkey speaks Redis's protocol.
CLIENT_SCHEMES = {
    "redis": "redis",
    "rediss": "rediss",
    "valkey": "redis",
    "valkeys": "rediss",
    "unix": "unix",
}
_SCHEMES_IN_WORDS = "redis://, rediss://, sentinel://, valkey://, valkeys:// or unix://"
_clients: dict[str, redis.Redis[bytes]] = {}
_clients_lock = threading.Lock()


def _forget_parents_lock() -> None:
    # A worker's heartbeat thread asks for its client every beat: a pool process forked at that moment
    # would wait for ever on a lock no thread of its own holds. The clients stay: redis-py opens new
    # connections in a child.
    global _clients_lock
    _clients_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_parents_lock)


def client() -> redis.Redis[bytes]:
    """A client for the configured URL, shared per process and URL (redis-py pools are thread-safe).

    ``ImproperlyConfigured`` when there is no URL, or one no client could use (``url_problem``)."""
    url = settings.redis_url()
    master = settings.sentinel_master() if url.startswith("sentinel://") else None
    key = f"{url}#{master}" if master else url
    with _clients_lock:
        found = _clients.get(key)
        if found is None:
            refuse_unusable(url)
            found = _clients[key] = _connect(url, master)
        return found


def refuse_unusable(url: str) -> None:
    """Raise ``ImproperlyConfigured`` if ``url``, the ledger's URL, is one no client could use."""
    from_broker = not settings.REDIS_URL
    problem = url_problem(url, from_broker=from_broker)
    if problem is not None:
        source = (
            f"The Celery broker URL, which the ledger uses while {PREFIX}REDIS_URL is unset,"
            if from_broker
            else f"{PREFIX}REDIS_URL"
        )
        raise ImproperlyConfigured(f"{source} {problem}.")


def url_problem(url: str, *, from_broker: bool = False) -> str | None:
    """What keeps a client from using ``url``, in words that repeat none of it (it may hold a password);
    ``None`` if nothing does. A broker's URL is read as kombu reads it: a host or database left out
    means the default one."""
    scheme, sep, _ = url.partition("://")
    if not sep:
        return f"is not a URL: write it as redis://host:port/db (or {_SCHEMES_IN_WORDS})"
    scheme = scheme.lower()
    if scheme == "sentinel":
        try:
            SentinelTarget.from_url(url)
        except ValueError as exc:
            return f"is not a valid sentinel URL: {exc}"
        return None
    if scheme not in CLIENT_SCHEMES:
        named = f"the scheme {scheme!r}" if re.fullmatch(r"[a-z][a-z0-9+.-]{0,19}", scheme) else "a scheme"
        return f"has {named}; the ledger needs {_SCHEMES_IN_WORDS}"
    parts = urlsplit(url)
    if scheme == "unix":
        return None if parts.path else "names no socket: write it as unix:///path/to/redis.sock"
    if from_broker:
        return None
    if not parts.hostname:
        return "names no host: write it as redis://host:port/db"
    try:
        parts.port  # noqa: B018 - parsed on access
    except ValueError:
        return "has a port that is not a number from 0 to 65535"
    database = parts.path.replace("/", "")
    if database and not database.isdigit():
        return "has a database that is not a number: write it as redis://host:port/db"
    return None


def address(url: str) -> str:
    """Where ``url`` points, for a log line: hosts and ports, or a socket's path; never a credential."""
    places = []
    for part in (urlsplit(one.strip()) for one in url.split(";") if one.strip()):
        if part.scheme == "unix":
            places.append(part.path)
            continue
        try:
            port = part.port
        except ValueError:
            port = None
        default = 26379 if part.scheme == "sentinel" else 6379
        places.append(f"{part.hostname or 'localhost'}:{port or default}")
    return ", ".join(places)


def _connect(url: str, master: str | None) -> redis.Redis[bytes]:
    options: dict[str, Any] = {
        "client_name": "celery-orphans",
        "socket_timeout": 5,
        "socket_connect_timeout": 5,
        "health_check_interval": 30,
        # A dropped connection (Redis restarted, a proxy closed it, a failover) is retried, not fatal.
        "retry": Retry(ExponentialBackoff(cap=1.0, base=0.05), 3),
        "retry_on_error": [ConnectionError, TimeoutError],
    }
    if master is None:
        scheme, _, rest = url.partition("://")
        return redis.Redis.from_url(f"{CLIENT_SCHEMES[scheme.lower()]}://{rest}", **options)
    target = SentinelTarget.from_url(url)
    # One try per sentinel per lookup: the lookup itself is retried with the command, as above.
    sentinel = Sentinel(
        target.sentinels,
        sentinel_kwargs={"socket_timeout": 1, "socket_connect_timeout": 1, "retry": Retry(NoBackoff(), 0)},
    )
    # Each new connection asks the sentinels where the master is; one to a master demoted by a failover
    # fails (READONLY) and is retried on the new one.
    return sentinel.master_for(
        master, db=target.db, username=target.username, password=target.password, **options
    )


@dataclass(frozen=True)
class SentinelTarget:
    """What a ``sentinel://`` URL names, written as Celery and kombu write it:
    ``sentinel://[[user]:password@]host:port[/db][;sentinel://host:port...]``. The credentials and the
    database of the first URL are the master's; each URL adds a sentinel."""

    sentinels: tuple[tuple[str, int], ...]
    db: int
    username: str | None
    password: str | None

    @classmethod
    def from_url(cls, url: str) -> SentinelTarget:
        parts = [urlsplit(one.strip()) for one in url.split(";") if one.strip()]
        if not parts or any(part.scheme != "sentinel" or not part.hostname for part in parts):
            raise ValueError("a sentinel URL lists sentinel://host:port addresses separated by ';'")
        first = parts[0]
        path = first.path.strip("/")
        if path and not path.isdigit():
            raise ValueError(f"the database of a sentinel URL is a number, got {path!r}")
        return cls(
            sentinels=tuple((str(part.hostname), part.port or 26379) for part in parts),
            db=int(path or 0),
            username=unquote(first.username) if first.username else None,
            password=unquote(first.password) if first.password else None,
        )


@dataclass(frozen=True)
class Keys:
    """Key names under one prefix. Task ids and node names are used verbatim inside keys."""

    prefix: str

    @classmethod
    def current(cls) -> Keys:
        return cls(settings.KEY_PREFIX)

    @property
    def inflight(self) -> str:
        return f"{self.prefix}:inflight"

    def entry(self, task_id: str) -> str:
        return f"{self.prefix}:entry:{task_id}"

    def fence(self, task_id: str) -> str:
        return f"{self.prefix}:fence:{task_id}"

    def checkpoint(self, task_id: str) -> str:
        return f"{self.prefix}:checkpoint:{task_id}"

    def lease(self, node: str, boot: str) -> str:
        return f"{self.prefix}:lease:{node}:{boot}"

    def boots(self, node: str) -> str:
        return f"{self.prefix}:boots:{node}"

    @property
    def watch(self) -> str:
        return f"{self.prefix}:watch"

    def machine(self, machine: str) -> str:
        return f"{self.prefix}:machine:{machine}"

    @property
    def presence(self) -> str:
        """The boots whose worker holds a presence connection, as their own renewal last saw it."""
        return f"{self.prefix}:presence"

    @property
    def presence_ring(self) -> str:
        """The same boots in a ring: each renewal looks at the presence of the boots that follow its own."""
        return f"{self.prefix}:presence-ring"

    def presence_channel(self, presence: str) -> str:
        """The channel a worker process stays subscribed to while it lives (``worker/presence.py``)."""
        return f"{self.prefix}:presence:{presence}"

    @property
    def last_sweep(self) -> str:
        return f"{self.prefix}:last-sweep"

    @property
    def lock(self) -> str:
        return f"{self.prefix}:lock"
