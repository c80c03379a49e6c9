"""The heartbeat: a worker's main process keeps its lease alive from a daemon thread.

It keeps beating while the main loop is busy, as a solo pool running a task is. The lease is read by
the sweep and by booting workers (``leases.py``). Each renewal also tells what it saw of the other
boots (lapsed leases, the processes on this machine) to ``on_renewed``: the worker's watch.
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
from collections.abc import Callable

import redis

from celery_orphans import leases, processes, scripts
from celery_orphans.conf import settings
from celery_orphans.store import Keys, client
from celery_orphans.worker import fence

logger = logging.getLogger(__name__)
HOST = socket.gethostname()
WATCH_LIMIT = 16  # lapsed boots a renewal reports at most; the next renewals report the rest


class Heartbeat:
    """Keeps the lease of one worker boot alive until stopped, and fences the boot off when it cannot.

    ``generation`` counts the boots of this process: when a renewal comes too late, or finds the lease
    gone, the boot's executions are forfeit (``fence.py``), and a new boot id takes a new lease.
    """

    def __init__(
        self,
        node: str,
        boot: str | None = None,
        on_forfeit: Callable[[int], int] | None = None,
        on_renewed: Callable[[leases.Seen], None] | None = None,
    ) -> None:
        self.node = node
        self.boot = boot or uuid.uuid4().hex
        self.pid = os.getpid()
        self.process = processes.this()
        self.machine = self.process.machine if self.process else None
        self.keys = Keys.current()
        self._tokens = itertools.count()
        self.interval = settings.HEARTBEAT_SECONDS
        self.lease_seconds = settings.LEASE_SECONDS
        # Executions give up this long before the lease would lapse: the sweep may act the moment it does.
        self.margin = self.lease_seconds / 5
        self.generation = 1
        self.valid_until = 0.0  # time.monotonic(); 0: no renewal holds (none yet, or forfeit since)
        self.on_forfeit = on_forfeit
        self.on_renewed = on_renewed
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False

    @property
    def lease_key(self) -> str:
        return self.keys.lease(self.node, self.boot)

    def token(self) -> str:
        """A token no other ledger entry of any boot carries: this boot's id and a count.

        Cheaper than a random one, which costs a system call on the path of every task.
        """
        return f"{self.boot}.{next(self._tokens):x}"

    def take(self) -> None:
        """Take the lease without the thread that keeps it: a worker does so before it forks its pool
        and consumes, so that its first deliveries are admitted under the lease. A thread running while
        the pool forks could leave a lock held in the child for ever, so the beating waits for
        ``start()``, and what this renewal saw of other boots is left to the next one."""
        self.renew(watching=False)

    def start(self) -> None:
        """Renew now, then keep renewing from a thread until stopped."""
        if self._thread is not None:
            return
        self.renew()
        self._thread = threading.Thread(
            target=self._run, name=f"celery-orphans-heartbeat-{self.node}", daemon=True
        )
        self._thread.start()

    def renew(self, *, watching: bool = True) -> bool:
        """Renew the lease (or take it, for a new boot); ``False`` when Redis could not be reached."""
        if os.getpid() != self.pid:  # a forked child must never keep its parent's lease alive
            self._stop.set()
            return False
        begun = time.monotonic()
        if self.valid_until and begun >= self.valid_until:
            self.forfeit("its lease was not renewed in time")
        try:
            seen = self._write(first=not self.valid_until, watching=watching)
            if seen is None:
                self.forfeit("its lease is gone from Redis")
                begun = time.monotonic()
                seen = self._write(first=True, watching=watching)
        except redis.RedisError as exc:
            if not self._failing:
                logger.warning("celery-orphans: cannot renew the lease of %s: %s", self.node, exc)
            self._failing = True
            return False
        if self._failing:
            logger.info("celery-orphans: lease of %s renewed again", self.node)
        self._failing = False
        if seen is None:
            return False
        # Redis set the expiry once it had the command, so no sooner than this.
        self.valid_until = begun + self.lease_seconds - self.margin
        fence.publish(self.generation, self.valid_until)
        if self.on_renewed is not None and (seen.lapsed or seen.neighbours):
            try:
                self.on_renewed(seen)
            except Exception:
                logger.exception("celery-orphans: the watch of %s failed", self.node)
        return True

    def _write(self, *, first: bool, watching: bool = True) -> leases.Seen | None:
        """Write the lease; what the renewal saw of other boots (nothing unless ``watching``), or ``None``
        if the lease was not written."""
        process = self.process
        value = json.dumps(
            {
                "node": self.node,
                "boot": self.boot,
                "pid": self.pid,
                "host": HOST,
                "machine": self.machine,
                "process": str(process) if process else None,
                "renewed_at": time.time(),
            }
        )
        # Without a process to record, the script leaves its fourth key alone: any key of ours will do.
        machine = self.keys.machine(self.machine) if self.machine else self.keys.watch
        keys = [self.lease_key, self.keys.boots(self.node), self.keys.watch, machine]
        member = leases.member(self.node, self.boot)
        lease_ms = int(self.lease_seconds * 1000)
        limit = WATCH_LIMIT if watching and self.on_renewed is not None else 0
        renew = client().register_script(scripts.RENEW)
        reply = renew(
            keys=keys,
            args=[value, lease_ms, self.boot, "1" if first else "0", member, str(process or ""), limit],
        )
        if not reply[0]:
            return None
        return leases.Seen.from_reply(reply, self.machine, (self.node, self.boot))

    def forfeit(self, why: str) -> None:
        """Give up every execution of this boot, and start a new boot with a lease of its own."""
        old_boot, old_generation = self.boot, self.generation
        self.generation += 1
        self.valid_until = 0.0
        fence.withdraw(self.generation)
        self.boot = uuid.uuid4().hex
        stopped = self.on_forfeit(old_generation) if self.on_forfeit is not None else 0
        logger.error(
            "celery-orphans: worker %s gives up its boot %s (%s): %s running executions are forfeit and "
            "will be recovered from the ledger; it goes on as boot %s",
            self.node,
            old_boot,
            why,
            stopped,
            self.boot,
        )
        try:
            self._drop(old_boot)  # so a sweep need not wait for the old lease to lapse
        except redis.RedisError as exc:
            logger.warning("celery-orphans: cannot drop the old lease of %s: %s", self.node, exc)

    def _drop(self, boot: str) -> None:
        leases.drop(self.node, boot, self.machine)

    def _run(self) -> None:
        while not self._stop.wait(self._until_next()):
            self.renew()

    def _until_next(self) -> float:
        """The next beat, or sooner, at the instant this boot's executions stop holding."""
        if not self.valid_until:
            return self.interval
        return max(0.0, min(self.interval, self.valid_until - time.monotonic()))

    def stop(self) -> None:
        """Stop beating and drop the lease, so the sweep need not wait for it to lapse."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval + 1)
        if os.getpid() != self.pid:
            return
        try:
            self._drop(self.boot)
        except redis.RedisError as exc:
            logger.warning("celery-orphans: cannot drop the lease of %s: %s", self.node, exc)


_current: Heartbeat | None = None


def current() -> Heartbeat | None:
    """The heartbeat of this worker process, if it runs one."""
    return _current if _current is not None and _current.pid == os.getpid() else None


def take(
    node: str,
    on_forfeit: Callable[[int], int] | None = None,
    on_renewed: Callable[[leases.Seen], None] | None = None,
) -> Heartbeat:
    """Take this process's lease, not yet kept alive (``Heartbeat.take``); ``on_forfeit(generation)``
    stops the executions of a boot given up, ``on_renewed(seen)`` hears what a renewal saw of other
    boots."""
    global _current
    beat = current()
    if beat is None:
        beat = _current = Heartbeat(node, on_forfeit=on_forfeit, on_renewed=on_renewed)
        beat.take()
        logger.info("celery-orphans: lease of %s (boot %s) taken", node, beat.boot)
    return beat


def start(
    node: str,
    on_forfeit: Callable[[int], int] | None = None,
    on_renewed: Callable[[leases.Seen], None] | None = None,
) -> Heartbeat:
    """Take this process's lease if it holds none, and keep it alive from a thread (see ``take``)."""
    beat = take(node, on_forfeit, on_renewed)
    beat.start()
    return beat


def stop() -> None:
    global _current
    beat, _current = current(), None
    if beat is not None:
        beat.stop()
