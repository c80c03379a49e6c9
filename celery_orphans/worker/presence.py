"""A worker process's presence: a connection to the ledger's Redis that exists only while the process lives.

The main process holds one connection of its own, subscribed to a channel no other process uses
(``Keys.presence_channel``). When the kernel closes it (a SIGKILL, an OOM kill, a crash: the process is
gone), Redis stops counting the subscriber within milliseconds (``benchmarks/liveness_signals.py``); when
the network goes silent instead (a partition, a frozen proxy, a blackhole), Redis keeps it for as long as
its ``tcp-keepalive`` allows, minutes by default. So a boot whose channel lost its subscriber while its
process may be alive is not judged by that alone:

- each renewal of the lease runs ``scripts.PRESENCE`` in the same round trip: it records the boot's
  presence only while its own channel is subscribed on this very Redis server (its run_id), and looks at
  the presence of the boots that follow it in a ring, marking a silent one missing (Redis's time);
- a missing boot is judged gone (``scripts.PRESENCE_LOST``, by the watch) only once it has not renewed
  for its wait since the mark: a heartbeat and half a second, within which a live worker renews, and its
  renewal clears the mark or, finding its own channel unsubscribed, withdraws its presence, so that only
  its lease can tell from then on;
- and never before its own executions are forfeit: a live worker stalled longer than its wait while
  Redis's end of its connection was closed (a ``CLIENT KILL``, a middlebox) has stopped them by then, so
  presence cannot run its task twice. When that is, and how a prefork worker makes it the moment its
  connection ended by itself, is ``presence_loss.py``;
- its pool processes die with it (Celery has the kernel kill each prefork pool process the moment the
  main process dies; ``watchdog.py`` is the fallback), so nothing of the boot runs on when it is judged.

The connection is opened once the pool has forked, and a process forked later closes its copy at once
(a copy held by a pool process would keep the subscription after the main process died). Losing it (a
reset, a Redis restart) costs nothing on a live worker: the thread connects again, and the heartbeat
renews at once.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import select
import threading
import time
import uuid
import weakref
import zlib
from collections.abc import Callable
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from celery_orphans import leases, logs, scripts
from celery_orphans.conf import settings
from celery_orphans.store import Keys, client
from celery_orphans.worker import forfeit, validity
from celery_orphans.worker.presence_loss import Loss, early_seconds, server_loading, wait_seconds

logger = logs.get(__name__)

PRESENCE_SHA = hashlib.sha1(scripts.PRESENCE.encode()).hexdigest()
CLIENT_NAME = "celery-orphans-presence"
# How many boots that follow its own in the ring each renewal looks at: each boot is looked at by as many.
SUCCESSORS = 2
POLL_SECONDS = 1.0  # how often the reading thread looks up from its wait, to notice a stop

_instances: weakref.WeakSet[Presence] = weakref.WeakSet()


class Presence:
    """The presence connection of one worker process, kept by a thread of its own until ``stop``."""

    def __init__(
        self,
        node: str,
        on_change: Callable[[], None] | None = None,
        *,
        pool: Any = "prefork",
    ) -> None:
        """``on_change()`` is called from the thread each time the subscription is made, and when it ended
        by itself where that forfeits the executions (``presence_loss.Loss``): the heartbeat renews at
        once, so that its presence is recorded, or withdrawn, without waiting for the next beat.
        ``pool``: the worker's pool class, or Celery's name for it. Whether it can stop an execution
        decides ``early_seconds``; whether its executions run in processes that watch for themselves
        (the prefork pool's), whether losing the connection can forfeit them in time (``presence_loss``)."""
        self.node = node
        self.keys = Keys.current()
        self.channel = self.keys.presence_channel(uuid.uuid4().hex)
        self.on_change = on_change
        self.pid = os.getpid()
        self.wait_ms = int(wait_seconds() * 1000)
        self.stoppable, self.self_watching = validity.stoppable(pool), validity.self_watching(pool)
        self.early_ms = int(early_seconds(self.stoppable) * 1000)
        self.loss = Loss(node, self._changed)
        self._conn: Any = None
        self._subscribed = threading.Event()
        self._again = threading.Event()  # the renewal says Redis no longer counts the subscription
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._refused = False
        _instances.add(self)

    @property
    def subscribed(self) -> bool:
        return self._subscribed.is_set() and os.getpid() == self.pid

    def start(self) -> None:
        if self._thread is None and os.getpid() == self.pid:
            self._thread = threading.Thread(target=self._run, name="celery-orphans-presence", daemon=True)
            self._thread.start()

    def wait_subscribed(self, timeout: float) -> bool:
        """Wait until the channel is subscribed (a test's and a boot's first renewal may wait)."""
        return self._subscribed.wait(timeout)

    def stop(self) -> None:
        self._stop.set()
        self.loss.closed()
        self._close()

    # The renewal's side: one more script call in its round trip, and what its reply says.

    def commands(self, member: str, *, watching: bool) -> list[tuple[Any, ...]]:
        """The renewal's presence call for ``member`` (``scripts.PRESENCE``)."""
        keys = [self.keys.presence, self.keys.presence_ring, self.keys.watch]
        args = [
            member,
            self.channel if self.subscribed else "",
            ring_place(member),
            SUCCESSORS if watching else 0,
            self.wait_ms,
            self.early_ms,
        ]
        return [("EVALSHA", PRESENCE_SHA, len(keys), *keys, *args)]

    def script(self, commands: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
        """The same calls with the script's text, for a Redis that lost its scripts."""
        return [("EVAL", scripts.PRESENCE, *command[2:]) for command in commands]

    def heard(self, reply: Any) -> list[tuple[str, str, float]]:
        """Read the renewal's presence reply: the boots missing, with the seconds left of their wait.
        A subscription Redis does not count (its end of the connection reset, another server since a
        failover) is made again."""
        if isinstance(reply, Exception) or not reply:
            if isinstance(reply, Exception) and not self._refused:
                self._refused = True  # said once: the lease alone tells of this worker meanwhile
                logger.warning(
                    "the ledger's Redis refuses the presence of %s (%s): only its lease tells of its death",
                    self.node,
                    reply,
                )
            return []
        self._refused = False
        if not reply[0] and self.subscribed:
            logger.info("the presence of %s is not seen by Redis: subscribing again", self.node)
            self._again.set()
            self._close()
        missing = []
        for name, left in zip(reply[1::2], reply[2::2]):
            boot, _, node = (name.decode() if isinstance(name, bytes) else str(name)).partition(" ")
            missing.append((node, boot, int(left) / 1000))
        return missing

    # The connection, kept by the thread.

    def _run(self) -> None:
        backoff, held_since = 0.1, 0.0
        while not self._stop.is_set():
            try:
                self._subscribe()
                held_since = time.monotonic()
                self._changed()
                self._hold()
            except Exception as exc:  # whatever ended it (a reset, a close from the renewal's side)
                if not self._stop.is_set():
                    logger.debug("presence connection of %s: %r", self.node, exc)
                if not self._subscribed.is_set() and server_loading(exc):
                    self.loss.loading()
            lost = self._subscribed.is_set()
            self._subscribed.clear()
            if lost and not self._again.is_set() and not self._stop.is_set():
                self.loss.lost(self.early_ms)
            self._close()
            if self._stop.is_set():
                return
            heartbeat = float(settings.HEARTBEAT_SECONDS)
            # A connection that held a heartbeat is made again at once; one dropped as soon as it is made
            # (an eviction, an ACL) is tried less and less often, and renews no more than that. While the
            # fence is armed, it is tried again at once each time.
            held = lost and time.monotonic() - held_since > heartbeat
            backoff = 0.1 if held or self.loss.armed else min(heartbeat, backoff * 2)
            self._stop.wait(backoff)

    def _changed(self) -> None:
        if self.on_change is not None:
            try:
                self.on_change()
            except Exception:
                logger.exception("the presence of %s could not tell its heartbeat", self.node)

    def _subscribe(self) -> None:
        ledger = client()
        pool = ledger.connection_pool
        timeout = float(settings.HEARTBEAT_SECONDS)
        conn = pool.connection_class(
            **{
                **pool.connection_kwargs,
                "health_check_interval": 0,
                "retry": Retry(NoBackoff(), 0),
                "client_name": CLIENT_NAME,
                "socket_timeout": timeout,
                "socket_connect_timeout": timeout,
                "socket_keepalive": True,
            }
        )
        with self._lock:
            self._conn = conn
        self._again.clear()
        conn.connect()
        conn.send_command("SUBSCRIBE", self.channel)
        reply = _read(conn)
        if not isinstance(reply, list) or len(reply) < 3 or reply[0] not in (b"subscribe", "subscribe"):
            raise ValueError(f"unexpected reply to SUBSCRIBE: {reply!r}")
        self.early_ms = self.loss.claim(conn._sock.fileno(), self.stoppable, self.self_watching)
        self._subscribed.set()
        self.loss.kept()

    def _hold(self) -> None:
        """Wait on the connection until it ends (end of file, a reset), or until the renewal says Redis
        does not count it."""
        conn = self._conn
        sock = getattr(conn, "_sock", None)
        if sock is None:
            raise redis.ConnectionError("no socket")
        while not self._stop.is_set() and not self._again.is_set():
            if _ready(sock):
                _read(conn)  # a message nobody sends, or the end: raises ConnectionError

    def _close(self) -> None:
        with self._lock:
            conn, self._conn = self._conn, None
        if conn is not None and os.getpid() == self.pid:
            forfeit.presence_socket(0)  # before its close: a pool process must not read it as Redis's
            with contextlib.suppress(Exception):  # what may already be broken
                conn.disconnect()

    def _forget(self) -> None:
        """In a process just forked: close this copy of the connection without touching the parent's."""
        conn = self._conn
        sock = getattr(conn, "_sock", None) if conn is not None else None
        if sock is not None:
            with contextlib.suppress(OSError):
                os.close(sock.detach())
        self._conn = None
        self._subscribed = threading.Event()
        self._thread = None


def _ready(sock: Any) -> bool:
    """Whether ``sock`` has something to read (its end, too) within ``POLL_SECONDS``: poll where there is
    one (eventlet's green select has none, and select stops at descriptor 1024)."""
    if hasattr(select, "poll"):
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN | select.POLLERR | select.POLLHUP)
        return bool(poller.poll(POLL_SECONDS * 1000))
    readable, _, broken = select.select([sock], [], [sock], POLL_SECONDS)
    return bool(readable or broken)


def _read(conn: Any) -> Any:
    """One reply: over RESP3 a subscription's replies are pushes, which redis-py otherwise skips over."""
    try:
        return conn.read_response(push_request=True)
    except TypeError:  # a redis-py without pushes speaks RESP2 alone
        return conn.read_response()


def ring_place(member: str) -> int:
    """Where ``member`` sits in the ring: spread evenly, the same in every process."""
    return zlib.crc32(member.encode())


def _after_fork_in_child() -> None:
    for presence in list(_instances):
        presence._forget()


def missing_after(seen: leases.Seen, missing: list[tuple[str, str, float]]) -> leases.Seen:
    """``seen`` with the boots whose presence is missing."""
    if not missing:
        return seen
    return leases.Seen(seen.lapsed, seen.neighbours, missing)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
