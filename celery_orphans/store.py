"""The Redis/Valkey connection and the names of every key celery-orphans writes."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import redis
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError, TimeoutError
from redis.retry import Retry

from celery_orphans.conf import settings

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
    """A client for the configured URL, shared per process and URL (redis-py pools are thread-safe)."""
    url = settings.redis_url()
    with _clients_lock:
        found = _clients.get(url)
        if found is None:
            found = _clients[url] = redis.Redis.from_url(
                url,
                client_name="celery-orphans",
                socket_timeout=5,
                socket_connect_timeout=5,
                health_check_interval=30,
                # A dropped connection (Redis restarted, a proxy closed it) is retried, not fatal.
                retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), 3),
                retry_on_error=[ConnectionError, TimeoutError],
            )
        return found


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
    def last_sweep(self) -> str:
        return f"{self.prefix}:last-sweep"

    @property
    def lock(self) -> str:
        return f"{self.prefix}:lock"
