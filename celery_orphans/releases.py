"""Removing the ledger entries of finished tasks without holding up the worker's next task.

With ``acks_late`` and a prefetch of one, the worker's main process fetches the next task only after it
has acknowledged the last one, so a Redis round trip made at the acknowledgement is paid once per task
in throughput. The removal is queued instead, and carried by the next ledger write, which the worker
makes moments later for its next task (one call does both). When no task follows, a thread of the main
process sends what is queued after ``FLUSH_DELAY_SECONDS``.

That changes nothing the ledger guarantees: the entry of a task exists before its body runs, a removal
compares the token written with the entry (a newer copy's entry is never touched), and an entry left
behind when the process dies before its removal is forgotten by the next sweep, which finds the task's
result row finished.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import redis

from celery_orphans.ledger import Ledger

logger = logging.getLogger(__name__)

# Long enough for the next task's ledger write to carry the removal while tasks keep coming, short
# enough that an idle worker's finished tasks leave the ledger well within any sweep's grace.
FLUSH_DELAY_SECONDS = 0.2


class Releaser:
    """``(task_id, token)`` removals per ledger, taken by the next ledger write or flushed by a thread."""

    def __init__(self, delay: float = FLUSH_DELAY_SECONDS) -> None:
        self.delay = delay
        self._pending: dict[Ledger, list[tuple[str, str]]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = 0

    def release(self, ledger: Ledger, task_id: str, token: str) -> None:
        """Queue the removal of ``task_id``'s entry if it still carries ``token``."""
        with self._lock:
            self._pending.setdefault(ledger, []).append((task_id, token))
            self._ensure_thread()
        self._wake.set()

    def take(self, ledger: Ledger) -> list[tuple[str, str]]:
        """The removals queued for ``ledger``, for a ledger write to carry; they are no longer queued."""
        with self._lock:
            return self._pending.pop(ledger, [])

    def give_back(self, ledger: Ledger, releases: list[tuple[str, str]]) -> None:
        """Queue again removals whose carrying write failed."""
        if releases:
            with self._lock:
                self._pending.setdefault(ledger, [])[:0] = releases
            self._wake.set()

    def flush(self) -> int:
        """Carry out every queued removal now; returns how many were sent."""
        with self._lock:
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

    def _ensure_thread(self) -> None:
        # Threads do not survive a fork: a process that inherited this object starts its own.
        if self._thread is not None and self._pid == os.getpid() and self._thread.is_alive():
            return
        self._pid = os.getpid()
        self._thread = threading.Thread(target=self._run, name="celery-orphans-release", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            # Whatever the next task's ledger write has not carried by then.
            time.sleep(self.delay)
            self.flush()


releaser = Releaser()
