"""The ledger writes of a worker's main process that do not hold up its next task.

With ``acks_late`` and a prefetch of one, the worker's main process fetches a task, records it in the
ledger, hands it to the pool, and fetches the next only once the last is acknowledged: every Redis round
trip on that path is paid once per task in throughput. Two kinds of write leave that path:

- The entry of a first-hand delivery (``redelivery.first_hand``: one the broker had not delivered before)
  is sent without waiting for the answer, on a connection of the outbox's own. A copy of a task is
  recovered or marked terminal only after a delivery of it was recorded, so a copy never delivered before
  cannot have been overtaken, and there is no verdict to wait for. The answer is read before anything
  else is sent on that connection, or by the outbox's thread; one that reports an error is logged then.
- A finished task's removal is queued and carried by the next entry written, which the worker sends
  moments later for its next task (one call does both). When no task follows, the thread sends what is
  queued after ``FLUSH_DELAY_SECONDS``.

What the ledger guarantees stays. An entry's write is on its way before the task reaches the pool, so
Redis has it before the task's body can get far, and has it even if the worker is killed right after (the
kernel still delivers what the process sent). A removal is sent only once every entry written before it
has been answered, and it compares the token written with the entry, so it never touches a newer copy's
entry. An entry left behind when the process dies before its removal is forgotten by the next sweep,
which finds the task's result row finished.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import redis

from celery_orphans.ledger import Entry, Ledger, admission

if TYPE_CHECKING:
    from redis.connection import AbstractConnection

logger = logging.getLogger(__name__)

# Long enough for the next task's ledger write to carry the removal while tasks keep coming, short
# enough that an idle worker's finished tasks leave the ledger well within any sweep's grace.
FLUSH_DELAY_SECONDS = 0.2


@dataclass
class _Line:
    """A connection of the outbox's own to one ledger's Redis, and the write whose answer is owed."""

    ledger: Ledger
    conn: AbstractConnection
    owed: tuple[Entry, list[tuple[str, str]]] | None = None  # the entry, and the removals it carried


class Outbox:
    """Entries sent without waiting, and ``(task_id, token)`` removals queued, per ledger."""

    def __init__(self, delay: float = FLUSH_DELAY_SECONDS) -> None:
        self.delay = delay
        self._pending: dict[Ledger, list[tuple[str, str]]] = {}
        self._lines: dict[Ledger, _Line] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = 0

    def admit(self, ledger: Ledger, entry: Entry) -> None:
        """Write ``entry``, carrying the queued removals, without waiting for Redis's answer.

        Raises ``redis.RedisError`` when it could not be sent; nothing was written then, and the
        removals stay queued.
        """
        with self._lock:
            self._ensure_process()
            line = self._lines.get(ledger)
            if line is None:
                line = self._lines[ledger] = _Line(ledger, ledger.client.connection_pool.make_connection())
            self._settle(line)
            releases = self._pending.pop(ledger, [])
            try:
                ledger.send_admit(line.conn, entry, releases)
            except redis.RedisError:
                line.conn.disconnect()
                self._pending.setdefault(ledger, [])[:0] = releases
                raise
            line.owed = (entry, releases)
        self._wake.set()

    def release(self, ledger: Ledger, task_id: str, token: str) -> None:
        """Queue the removal of ``task_id``'s entry if it still carries ``token``."""
        with self._lock:
            self._ensure_process()
            self._pending.setdefault(ledger, []).append((task_id, token))
        self._wake.set()

    def take(self, ledger: Ledger) -> list[tuple[str, str]]:
        """The removals queued for ``ledger``, for a ledger write to carry; they are no longer queued.

        Every entry this outbox sent is answered first, so a removal never overtakes its entry.
        """
        with self._lock:
            self._settle_all()
            return self._pending.pop(ledger, [])

    def give_back(self, ledger: Ledger, releases: list[tuple[str, str]]) -> None:
        """Queue again removals whose carrying write failed."""
        if releases:
            with self._lock:
                self._pending.setdefault(ledger, [])[:0] = releases
            self._wake.set()

    def settle(self) -> None:
        """Wait for the answer to every entry sent, so each is in Redis (or its failure logged)."""
        with self._lock:
            self._settle_all()

    def flush(self) -> int:
        """Settle, then carry out every queued removal now; returns how many were sent."""
        with self._lock:
            self._settle_all()
            pending, self._pending = self._pending, {}
        for ledger, releases in pending.items():
            try:
                ledger.release_many(releases)
            except redis.RedisError as exc:
                # Left for the sweep, which forgets an entry whose task finished.
                logger.warning(
                    "celery-orphans: cannot remove %d finished tasks from the ledger (%s): %s",
                    len(releases),
                    ", ".join(task_id for task_id, _ in releases[:5]),
                    exc,
                )
        return sum(len(releases) for releases in pending.values())

    def _settle_all(self) -> None:
        for line in self._lines.values():
            self._settle(line)

    def _settle(self, line: _Line) -> None:
        owed, line.owed = line.owed, None
        if owed is None:
            return
        entry, releases = owed
        try:
            try:
                answer = admission(entry.task_id, line.conn.read_response())
            except (redis.ConnectionError, redis.TimeoutError):
                # The connection broke before the answer came: whether or not Redis carried the write
                # out, doing it again the slow way, whose client reconnects, leaves the same state.
                line.conn.disconnect()
                answer = line.ledger.admit_delivery(entry, releases)
        except redis.RedisError as exc:
            logger.warning(
                "celery-orphans: cannot record %s[%s] in the ledger: %s; it runs, but could not be "
                "recovered if its worker died",
                entry.task_name,
                entry.task_id,
                exc,
            )
            return
        if not answer.admitted:
            # Only a caller sending one task id twice gets here: its other copy was recovered or closed.
            logger.warning(
                "celery-orphans: %s[%s] runs although its fence has moved past this copy; "
                "was the same task id sent twice?",
                entry.task_name,
                entry.task_id,
            )

    def _ensure_process(self) -> None:
        # Neither threads nor connections survive a fork: a process that inherited this object starts
        # its own, and leaves its parent's sockets alone.
        if self._pid == os.getpid() and self._thread is not None and self._thread.is_alive():
            return
        if self._pid != os.getpid():
            self._lines = {}
            self._pid = os.getpid()
        self._thread = threading.Thread(target=self._run, name="celery-orphans-outbox", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            # Whatever the next task's ledger write has not carried by then.
            time.sleep(self.delay)
            self.flush()


outbox = Outbox()
