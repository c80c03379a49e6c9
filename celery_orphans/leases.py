"""Worker leases: each worker's main process proves it is alive by renewing one Redis key.

The key holds the node name and an id unique to this boot of the process, and expires on its own
(Redis enforces it, so no clocks are compared). A daemon thread renews it, so it keeps beating while the
main loop is busy, as a solo pool running a task is.
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
from collections.abc import Iterable

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


def fresh_boots(
    nodes: Iterable[str], conn: redis.Redis[bytes] | None = None, *, prune: bool = True
) -> dict[str, frozenset[str]]:
    """For each node name, the boot ids whose lease has not lapsed (two round trips in all).

    With ``prune``, lapsed boot ids are dropped from their node's set, so the sets of names that never
    come back do not grow with every crash. A live boot wrongly dropped adds itself at its next beat.
    """
    conn = conn or client()
    keys = Keys.current()
    nodes = sorted(set(nodes))
    pipe = conn.pipeline(transaction=False)
    for node in nodes:
        pipe.hkeys(keys.boots(node))
    boots = {
        node: sorted(b.decode() if isinstance(b, bytes) else str(b) for b in members)
        for node, members in zip(nodes, pipe.execute())
    }
    pipe = conn.pipeline(transaction=False)
    pairs = [(node, boot) for node in nodes for boot in boots[node]]
    for node, boot in pairs:
        pipe.exists(keys.lease(node, boot))
    alive = {pair for pair, exists in zip(pairs, pipe.execute() if pairs else []) if exists}
    lapsed = [pair for pair in pairs if pair not in alive]
    if prune and lapsed:
        pipe = conn.pipeline(transaction=False)
        for node, boot in lapsed:
            pipe.hdel(keys.boots(node), boot)
        pipe.execute()
    return {node: frozenset(b for b in boots[node] if (node, b) in alive) for node in nodes}


def last_beats(
    pairs: Iterable[tuple[str, str]], conn: redis.Redis[bytes] | None = None
) -> dict[tuple[str, str], float]:
    """When each (node, boot) last renewed its lease, for the boots still listed under their node."""
    conn = conn or client()
    keys = Keys.current()
    pairs = list(pairs)
    pipe = conn.pipeline(transaction=False)
    for node, boot in pairs:
        pipe.hget(keys.boots(node), boot)
    found = {}
    for pair, value in zip(pairs, pipe.execute() if pairs else []):
        try:
            found[pair] = float(value)
        except (TypeError, ValueError):
            continue
    return found


def count() -> int:
    """How many worker boots hold a live lease now (a SCAN: for status pages, not hot paths)."""
    return sum(1 for _ in client().scan_iter(match=f"{Keys.current().prefix}:lease:*", count=500))


def renewals(
    node: str, boots: Iterable[str], conn: redis.Redis[bytes] | None = None
) -> dict[str, bytes | None]:
    """The current lease value of each boot (it changes on every renewal); ``None`` once lapsed."""
    conn = conn or client()
    keys = Keys.current()
    boots = sorted(boots)
    values = conn.mget([keys.lease(node, boot) for boot in boots]) if boots else []
    return dict(zip(boots, values))


def renewed_within(node: str, boots: Iterable[str], seconds: float) -> frozenset[str]:
    """The boots whose lease is renewed within ``seconds``: proof that their process is alive.

    A boot whose lease neither lapses nor changes stays out; a lease is renewed every heartbeat, so
    watching for two heartbeats tells a live process from one that was killed a moment ago.
    """
    first = renewals(node, boots)
    watching = {boot for boot, value in first.items() if value is not None and not _provably_gone(value)}
    deadline = time.monotonic() + seconds
    renewed: set[str] = set()
    while watching and time.monotonic() < deadline:
        time.sleep(min(0.1, seconds))
        for boot, value in renewals(node, watching).items():
            if value is None:
                watching.discard(boot)
            elif value != first[boot]:
                renewed.add(boot)
                watching.discard(boot)
    return frozenset(renewed)


def _provably_gone(value: bytes) -> bool:
    """A lease written on this host by a process id that no longer exists is a dead boot's."""
    try:
        lease = json.loads(value)
        host, pid = lease["host"], int(lease["pid"])
    except (ValueError, KeyError, TypeError):
        return False
    if host != socket.gethostname() or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


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
