"""Removing the ledger entries of finished tasks without holding up the worker's next task.

With ``acks_late`` and a prefetch of one, the worker's main process fetches the next task only after it
has acknowledged the last one, so a Redis round trip made at the acknowledgement is paid once per task
in throughput. The entry is removed instead by a thread of the main process, right after, several at a
time in one pipeline. That changes nothing the ledger guarantees: the entry of a task exists before its
body runs, the removal compares the token written with it (a newer copy's entry is never touched), and
an entry left behind when the process dies before the removal is forgotten by the next sweep, which
finds the task's result row finished.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque

import redis

from celery_orphans.ledger import Ledger

logger = logging.getLogger(__name__)


class Releaser:
    """A queue of ``(task_id, token)`` removals, carried out by a daemon thread as they arrive."""

    def __init__(self) -> None:
        self._pending: deque[tuple[Ledger, str, str]] = deque()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = 0
        self._start_lock = threading.Lock()

    def release(self, ledger: Ledger, task_id: str, token: str) -> None:
        """Queue the removal of ``task_id``'s entry if it still carries ``token``."""
        self._pending.append((ledger, task_id, token))
        self._ensure_thread()
        self._wake.set()

    def flush(self) -> int:
        """Carry out every queued removal now; returns how many were sent."""
        batch: list[tuple[Ledger, str, str]] = []
        while self._pending:
            batch.append(self._pending.popleft())
        by_ledger: dict[Ledger, list[tuple[str, str]]] = {}
        for ledger, task_id, token in batch:
            by_ledger.setdefault(ledger, []).append((task_id, token))
        for ledger, releases in by_ledger.items():
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
        return len(batch)

    def _ensure_thread(self) -> None:
        # Threads do not survive a fork: a process that inherited this object starts its own.
        if self._thread is not None and self._pid == os.getpid() and self._thread.is_alive():
            return
        with self._start_lock:
            if self._thread is not None and self._pid == os.getpid() and self._thread.is_alive():
                return
            self._pid = os.getpid()
            self._thread = threading.Thread(target=self._run, name="celery-orphans-release", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            self.flush()


releaser = Releaser()
