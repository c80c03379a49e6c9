"""The heartbeat: a worker's main process keeps its lease alive from a daemon thread.

It keeps beating while the main loop is busy, as a solo pool running a task is. The lease is read by
the sweep and by booting workers (``leases.py``).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import socket
import threading
import time
import uuid

import redis

from celery_orphans.conf import settings
from celery_orphans.store import Keys, client

logger = logging.getLogger(__name__)


class Heartbeat:
    """Keeps the lease of one worker boot alive until stopped."""

    def __init__(self, node: str, boot: str | None = None) -> None:
        self.node = node
        self.boot = boot or uuid.uuid4().hex
        self.pid = os.getpid()
        self.keys = Keys.current()
        self._tokens = itertools.count()
        self.interval = settings.HEARTBEAT_SECONDS
        self.lease_ms = int(settings.LEASE_SECONDS * 1000)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False

    def token(self) -> str:
        """A token no other ledger entry of any boot carries: this boot's id and a count.

        Cheaper than a random one, which costs a system call on the path of every task.
        """
        return f"{self.boot}.{next(self._tokens):x}"

    def start(self) -> None:
        self.renew()
        self._thread = threading.Thread(
            target=self._run, name=f"celery-orphans-heartbeat-{self.node}", daemon=True
        )
        self._thread.start()

    def renew(self) -> bool:
        if os.getpid() != self.pid:  # a forked child must never keep its parent's lease alive
            self._stop.set()
            return False
        renewed_at = time.time()
        value = json.dumps(
            {
                "node": self.node,
                "boot": self.boot,
                "pid": self.pid,
                "host": socket.gethostname(),
                "renewed_at": renewed_at,
            }
        )
        try:
            pipe = client().pipeline(transaction=False)
            pipe.set(self.keys.lease(self.node, self.boot), value, px=self.lease_ms)
            # The node's boots, each with its last beat: outlives the lease, for "how long since".
            pipe.hset(self.keys.boots(self.node), self.boot, repr(renewed_at))
            pipe.execute()
        except redis.RedisError as exc:
            if not self._failing:
                logger.warning("celery-orphans: cannot renew the lease of %s: %s", self.node, exc)
            self._failing = True
            return False
        if self._failing:
            logger.info("celery-orphans: lease of %s renewed again", self.node)
        self._failing = False
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.renew()

    def stop(self) -> None:
        """Stop beating and drop the lease, so the sweep need not wait for it to lapse."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval + 1)
        if os.getpid() != self.pid:
            return
        try:
            pipe = client().pipeline(transaction=False)
            pipe.delete(self.keys.lease(self.node, self.boot))
            pipe.hdel(self.keys.boots(self.node), self.boot)
            pipe.execute()
        except redis.RedisError as exc:
            logger.warning("celery-orphans: cannot drop the lease of %s: %s", self.node, exc)


_current: Heartbeat | None = None


def current() -> Heartbeat | None:
    """The heartbeat of this worker process, if it runs one."""
    return _current if _current is not None and _current.pid == os.getpid() else None


def start(node: str) -> Heartbeat:
    global _current
    if _current is not None and _current.pid == os.getpid():
        return _current
    _current = Heartbeat(node)
    _current.start()
    logger.info("celery-orphans: lease of %s (boot %s) started", node, _current.boot)
    return _current


def stop() -> None:
    global _current
    beat, _current = current(), None
    if beat is not None:
        beat.stop()
