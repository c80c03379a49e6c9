"""The ledger writes of a worker's main process that do not hold up its next task.

With ``acks_late`` and a prefetch of one, the worker's main process fetches a task, records it in the
ledger, hands it to the pool, and fetches the next only once the last is acknowledged: every Redis round
trip on that path is paid once per task in throughput. Two kinds of write leave that path:

- The entry of a first-hand delivery (``redelivery.first_hand``: one the broker had not delivered before)
  is sent without waiting for the answer, on a connection of the outbox's own (``line.py``). A copy of a
  task is recovered or marked terminal only after a delivery of it was recorded, so a copy never delivered
  before cannot have been overtaken, and there is no verdict to wait for. The outbox's thread reads the
  answers, many at a time, within ``FLUSH_DELAY_SECONDS``; one that reports an error is logged then.
- A finished task's removal is queued and carried by the next entry written, which the worker sends
  moments later for its next task (one call does both). When no task follows, the thread sends what is
  queued after ``FLUSH_DELAY_SECONDS``.

The main loop never waits behind the outbox's thread while it waits for Redis: what is queued is guarded
by a lock held for moves in memory only; answers are read under a lock of their own.

What the ledger guarantees stays. An entry's write is on its way before the task reaches the pool, so
Redis has it before the task's body can get far, and has it even if the worker is killed right after (the
kernel still delivers what the process sent). A removal follows its entry's write on the same
connection, which Redis serves in order, or, sent another way, only once that write has been answered;
and it compares the token written with the entry, so it never touches a newer copy's entry. An entry
left behind when the process dies before its removal is forgotten by the next sweep, which finds the
task's result row finished.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import redis

from celery_orphans import logs
from celery_orphans.entry import Entry
from celery_orphans.ledger import Ledger, admission
from celery_orphans.worker import admission_line
from celery_orphans.worker.line import Line, Write, check, connect, not_recorded, redo

logger = logs.get(__name__)

# Long enough for the next task's ledger write to carry the removal while tasks keep coming, short
# enough that an idle worker's finished tasks leave the ledger well within any sweep's grace.
FLUSH_DELAY_SECONDS = 0.2


class Outbox:
    """Entries sent without waiting, and ``(task_id, token)`` removals queued, per ledger."""

    def __init__(self, delay: float = FLUSH_DELAY_SECONDS) -> None:
        self.delay = delay
        self._pending: dict[Ledger, list[tuple[str, str]]] = {}
        self._lines: dict[Ledger, Line] = {}
        self._lock = threading.Lock()  # what is queued and owed: held for moves in memory only
        self._reading = threading.Lock()  # held while answers are awaited
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        _outboxes.add(self)

    def admit(
        self,
        ledger: Ledger,
        entry: Entry,
        lease: str,
        on_answer: Callable[[bool], None] | None = None,
        seconds: float | None = None,
    ) -> None:
        """Write ``entry``, carrying the queued removals, without waiting for Redis's answer; once it
        comes, ``on_answer(recorded)`` says whether Redis recorded the entry. Raises
        ``redis.RedisError`` when it could not be sent; nothing was written then, the removals stay queued.
        A connection made for it is made within ``seconds``, if given (``line.connect``).
        """
        with self._lock:
            self._ensure_thread()
            releases = self._pending.pop(ledger, [])
        line: Line | None = None
        try:
            line = self._line(ledger, seconds)
            with line.sending:
                if line.lost:
                    raise redis.ConnectionError("the outbox's connection was lost")
                ledger.send_admit(line.conn, entry, releases, lease)
                with self._lock:  # in the order sent: answers are read in that order
                    line.owed.append(Write(entry, releases, lease, on_answer))
        except redis.RedisError:
            self.give_back(ledger, releases)
            if line is not None:
                self._lost(line)
            raise
        self._nudge()

    def release(
        self, ledger: Ledger, task_id: str, token: str, *, now: bool = False, seconds: float | None = None
    ) -> None:
        """Queue the removal of ``task_id``'s entry if it still carries ``token``; with ``now``, remove it
        (and whatever else is queued) before returning, within ``seconds`` if given: what Redis has not
        answered by then is left to the outbox's thread."""
        with self._lock:
            self._ensure_thread()
            self._pending.setdefault(ledger, []).append((task_id, token))
        if now:
            self.flush(seconds)
        else:
            self._nudge()

    def take(self, ledger: Ledger, seconds: float | None = None) -> list[tuple[str, str]]:
        """The removals queued for ``ledger``, for a ledger write to carry; they are no longer queued.

        Every entry this outbox sent is answered first, so a removal never overtakes its entry; when those
        answers do not all come within ``seconds`` (if given), none is taken: they stay queued.
        """
        if not self._settle_all(seconds):
            return []
        with self._lock:
            return self._pending.pop(ledger, [])

    def give_back(self, ledger: Ledger, releases: list[tuple[str, str]]) -> None:
        """Queue again removals whose carrying write failed."""
        if releases:
            with self._lock:
                self._pending.setdefault(ledger, [])[:0] = releases
            self._nudge()

    def settle(self, seconds: float | None = None) -> bool:
        """Wait for the answer to every entry sent, so each is in Redis (or its failure logged); given
        ``seconds``, no longer, and ``False`` if some are still owed then."""
        return self._settle_all(seconds)

    def flush(self, seconds: float | None = None) -> int:
        """Settle, then carry out every queued removal now; returns how many were sent. Given ``seconds``,
        it waits for Redis no longer, over a bounded connection (``admission_line``), and what was not
        answered by then stays queued for the outbox's thread."""
        deadline = None if seconds is None else time.monotonic() + seconds
        if not self._settle_all(seconds):
            self._nudge()
            return 0
        with self._lock:
            pending, self._pending = self._pending, {}
        for ledger, releases in pending.items():
            if deadline is None:
                self._send(ledger, releases)
            else:
                self._send_within(ledger, releases, deadline)
        return sum(len(releases) for releases in pending.values())

    def _send_within(self, ledger: Ledger, releases: list[tuple[str, str]], deadline: float) -> None:
        try:
            admission_line.release_many(ledger, releases, deadline - time.monotonic())
        except (redis.ConnectionError, redis.TimeoutError):
            self.give_back(ledger, releases)  # sent again by the thread: a removal made twice is harmless
        except redis.RedisError:
            self._send(ledger, releases)  # a refusal: logged and let go, as the thread would

    @staticmethod
    def _send(ledger: Ledger, releases: list[tuple[str, str]]) -> None:
        # On a fault they are left for the sweep, which forgets an entry whose task finished.
        with logs.redis_fault_let_go(
            logger,
            "cannot remove %d finished tasks from the ledger (%s)",
            len(releases),
            ", ".join(task_id for task_id, _ in releases[:5]),
        ):
            ledger.release_many(releases)

    def _line(self, ledger: Ledger, seconds: float | None = None) -> Line:
        with self._lock:
            line = self._lines.get(ledger)
        if line is None:
            conn = connect(ledger, seconds)
            with self._lock:  # another thread may have made one meanwhile: one line per ledger
                line = self._lines.setdefault(ledger, Line(ledger, conn))
            if line.conn is not conn:
                conn.disconnect()
        return line

    def _settle_all(self, seconds: float | None = None) -> bool:
        """Read every answer owed; ``False`` if, given ``seconds``, they did not all come within them (what
        came is read, the rest stays owed, for the thread)."""
        deadline = None if seconds is None else time.monotonic() + seconds
        if not self._reading.acquire(
            timeout=-1 if deadline is None else max(0.0, deadline - time.monotonic())
        ):
            return False  # the thread waits for them: as long, here, would hold the main loop
        try:
            with self._lock:
                lines = list(self._lines.values())  # a line found lost leaves the dict
            return all(self._settle(line, deadline) for line in lines)
        finally:
            self._reading.release()

    def _settle(self, line: Line, deadline: float | None = None) -> bool:
        """Read the answers owed on ``line``, in the order the writes were sent (``_reading`` held);
        ``False`` if one had not begun to come by ``deadline``."""
        while True:
            with self._lock:
                if not line.owed or line.lost:
                    return True
                write = line.owed[0]
            try:
                # Waiting for an answer to begin leaves the connection as it was: it is read later.
                if deadline is not None and not line.conn.can_read(
                    timeout=max(0.0, deadline - time.monotonic())
                ):
                    return False
                # The connection is closed by _lost alone, which waits for a send under way.
                reply: Any = line.conn.read_response(disconnect_on_error=False)
            except (redis.ConnectionError, redis.TimeoutError):
                self._lost(line)
                return True
            except redis.ResponseError as exc:
                reply = exc
            with self._lock:
                if line.lost:  # by a failed send meanwhile: its writes are made again the slow way
                    return True
                line.owed.pop(0)
            if isinstance(reply, redis.exceptions.NoScriptError):  # Redis restarted: the slow way loads it
                redo(line.ledger, write)
            elif isinstance(reply, redis.ResponseError):
                not_recorded(write, reply)
            else:
                check(write, admission(write.entry.task_id, reply))

    def _lost(self, line: Line) -> None:
        """The connection broke with answers owed: whether or not Redis carried those writes out, making
        them again the slow way, whose client reconnects, leaves the same state."""
        with line.sending:
            line.lost = True
            line.conn.disconnect()
            with self._lock:
                if self._lines.get(line.ledger) is line:
                    del self._lines[line.ledger]  # the next write connects anew, wherever the ledger is now
                owed, line.owed = line.owed, []
        for write in owed:
            redo(line.ledger, write)

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
        self._lock, self._reading = threading.Lock(), threading.Lock()  # a parent's thread may hold them
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


outbox = Outbox()
