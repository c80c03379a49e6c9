"""The ledger writes of a worker's main process that do not hold up its next task.

With ``acks_late`` and a prefetch of one, the worker's main process fetches a task, records it in the
ledger, hands it to the pool, and fetches the next only once the last is acknowledged: every Redis round
trip on that path is paid once per task in throughput. Two kinds of write leave that path:

- The entry of a first-hand delivery (``redelivery.first_hand``: one the broker had not delivered before)
  is sent without waiting for the answer, on a connection of the outbox's own. A copy of a task is
  recovered or marked terminal only after a delivery of it was recorded, so a copy never delivered before
  cannot have been overtaken, and there is no verdict to wait for. The outbox's thread reads the
  answers, many at a time, within ``FLUSH_DELAY_SECONDS``; one that reports an error is logged then.
- A finished task's removal is queued and carried by the next entry written, which the worker sends
  moments later for its next task (one call does both). When no task follows, the thread sends what is
  queued after ``FLUSH_DELAY_SECONDS``.

What the ledger guarantees stays. An entry's write is on its way before the task reaches the pool, so
Redis has it before the task's body can get far, and has it even if the worker is killed right after (the
kernel still delivers what the process sent). A removal follows its entry's write on the same
connection, which Redis serves in order, or, sent another way, only once that write has been answered;
and it compares the token written with the entry, so it never touches a newer copy's entry. An entry
left behind when the process dies before its removal is forgotten by the next sweep, which finds the
task's result row finished.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import redis

from celery_orphans.entry import Entry
from celery_orphans.ledger import Admission, Ledger, admission

if TYPE_CHECKING:
    from redis.connection import AbstractConnection

logger = logging.getLogger(__name__)

# Long enough for the next task's ledger write to carry the removal while tasks keep coming, short
# enough that an idle worker's finished tasks leave the ledger well within any sweep's grace.
FLUSH_DELAY_SECONDS = 0.2


@dataclass
class _Line:
    """A connection of the outbox's own to one ledger's Redis, and the writes whose answers are owed."""

    ledger: Ledger
    conn: AbstractConnection
    owed: list[_Write] = field(default_factory=list)


@dataclass(frozen=True)
class _Write:
    """An entry sent without waiting, the removals it carried, and the lease of the boot that wrote it."""

    entry: Entry
    releases: list[tuple[str, str]]
    lease: str


class Outbox:
    """Entries sent without waiting, and ``(task_id, token)`` removals queued, per ledger."""

    def __init__(self, delay: float = FLUSH_DELAY_SECONDS) -> None:
        self.delay = delay
        self._pending: dict[Ledger, list[tuple[str, str]]] = {}
        self._lines: dict[Ledger, _Line] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        _outboxes.add(self)

    def admit(self, ledger: Ledger, entry: Entry, lease: str) -> None:
        """Write ``entry``, carrying the queued removals, without waiting for Redis's answer.

        Raises ``redis.RedisError`` when it could not be sent; nothing was written then, and the
        removals stay queued.
        """
        with self._lock:
            self._ensure_thread()
            line = self._line(ledger)
            releases = self._pending.pop(ledger, [])
            try:
                ledger.send_admit(line.conn, entry, releases, lease)
            except redis.RedisError:
                self._pending.setdefault(ledger, [])[:0] = releases
                self._lost(line)
                raise
            line.owed.append(_Write(entry, releases, lease))
        self._nudge()

    def release(self, ledger: Ledger, task_id: str, token: str, *, now: bool = False) -> None:
        """Queue the removal of ``task_id``'s entry if it still carries ``token``; with ``now``, remove it
        (and whatever else is queued for ``ledger``) before returning."""
        with self._lock:
            self._ensure_thread()
            self._pending.setdefault(ledger, []).append((task_id, token))
            if now:
                self._settle_all()
                self._send(ledger, self._pending.pop(ledger))
                return
        self._nudge()

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
            self._nudge()

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
            self._send(ledger, releases)
        return sum(len(releases) for releases in pending.values())

    @staticmethod
    def _send(ledger: Ledger, releases: list[tuple[str, str]]) -> None:
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

    def _line(self, ledger: Ledger) -> _Line:
        line = self._lines.get(ledger)
        if line is None:
            ledger.load_scripts()
            pool = ledger.client.connection_pool
            # No health check: its PING would read an answer owed to an earlier write. A connection
            # found dead has those writes made again, the slow way (_lost).
            conn = pool.connection_class(**{**pool.connection_kwargs, "health_check_interval": 0})
            line = self._lines[ledger] = _Line(ledger, conn)
        return line

    def _settle_all(self) -> None:
        for line in self._lines.values():
            self._settle(line)

    def _settle(self, line: _Line) -> None:
        """Read the answers owed on ``line``, in the order the writes were sent."""
        while line.owed:
            write = line.owed[0]
            try:
                reply = line.conn.read_response()
            except (redis.ConnectionError, redis.TimeoutError):
                self._lost(line)
                return
            except redis.exceptions.NoScriptError:
                # Redis lost its scripts (it restarted): the slow way loads the script again.
                line.owed.pop(0)
                self._redo(line.ledger, write)
                continue
            except redis.ResponseError as exc:
                line.owed.pop(0)
                _not_recorded(write.entry, exc)
                continue
            line.owed.pop(0)
            _check(write.entry, admission(write.entry.task_id, reply))

    def _lost(self, line: _Line) -> None:
        """The connection broke with answers owed: whether or not Redis carried those writes out, making
        them again the slow way, whose client reconnects, leaves the same state."""
        line.conn.disconnect()
        owed, line.owed = line.owed, []
        for write in owed:
            self._redo(line.ledger, write)

    @staticmethod
    def _redo(ledger: Ledger, write: _Write) -> None:
        try:
            answer = ledger.admit_delivery(write.entry, write.releases, lease=write.lease)
        except redis.RedisError as exc:
            _not_recorded(write.entry, exc)
            return
        _check(write.entry, answer)

    def _nudge(self) -> None:
        # The event stays set until the thread wakes: the thread is woken once per flush, not per task.
        if not self._wake.is_set():
            self._wake.set()

    def _ensure_thread(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._thread = threading.Thread(target=self._run, name="celery-orphans-outbox", daemon=True)
        self._thread.start()

    def _forget_parent(self) -> None:
        self._lock = threading.Lock()  # a thread of the parent may have held it at the fork
        self._wake = threading.Event()
        self._thread = None
        self._lines = {}
        self._pending = {}

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            # Whatever the next task's ledger write has not carried by then.
            time.sleep(self.delay)
            self.flush()


# Neither threads nor connections survive a fork: a child that inherited an outbox starts its own, and
# leaves its parent's sockets alone.
_outboxes: weakref.WeakSet[Outbox] = weakref.WeakSet()


def _forget_parents() -> None:
    for each in list(_outboxes):
        each._forget_parent()


os.register_at_fork(after_in_child=_forget_parents)


def _not_recorded(entry: Entry, exc: Exception) -> None:
    logger.warning(
        "celery-orphans: cannot record %s[%s] in the ledger: %s; it runs, but could not be recovered if "
        "its worker died",
        entry.task_name,
        entry.task_id,
        exc,
    )


def _check(entry: Entry, answer: Admission) -> None:
    if not answer.admitted:
        # Only a caller sending one task id twice gets here: its other copy was recovered or closed.
        logger.warning(
            "celery-orphans: %s[%s] runs although its fence has moved past this copy; "
            "was the same task id sent twice?",
            entry.task_name,
            entry.task_id,
        )


outbox = Outbox()
