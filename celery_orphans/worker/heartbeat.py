"""The heartbeat: a worker's main process keeps its lease alive from a daemon thread.

It keeps beating while the main loop is busy, as a solo pool running a task is. The lease is read by
the sweep and by booting workers (``leases.py``). Each renewal also tells what it saw of the other
boots (lapsed leases, the processes on this machine) to ``on_renewed``: the worker's watch. Its Redis
calls go over a connection of their own, each bounded by what is left of the boot's validity
(``bounded.py``); the boot is given up at that instant by the clock (``validity.py``), not by them.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis
from django.core.exceptions import ImproperlyConfigured

from celery_orphans import leases, logs
from celery_orphans.conf import settings
from celery_orphans.worker import clock, renewal
from celery_orphans.worker.presence import Presence
from celery_orphans.worker.renewal import Renewals
from celery_orphans.worker.validity import Validity, stoppable

logger = logs.get(__name__)
WATCH_LIMIT = 16  # lapsed boots a renewal reports at most; the next renewals report the rest
# While no lease holds, the next try comes this soon, then twice as late each time, up to a heartbeat:
# a ledger that comes back is used within a heartbeat, as a renewal after an outage would be.
FIRST_RETRY_SECONDS = 0.25


class Heartbeat:
    """Keeps the lease of one worker boot alive until stopped, and gives the boot up when it cannot.

    ``generation`` counts the boots of this process: when no renewal was answered in time, or one finds
    the lease gone, the boot's executions are forfeit (``forfeit.py``), and a new boot id takes a new lease.
    """

    def __init__(
        self,
        node: str,
        boot: str | None = None,
        on_forfeit: Callable[[int], int] | None = None,
        on_renewed: Callable[[leases.Seen], None] | None = None,
        *,
        pool: Any = None,
    ) -> None:
        """``pool``: the worker's pool class, or Celery's name for it (prefork if ``None``); whether it can
        stop a running execution (``stoppable``) decides what the instant passing does (``Validity``)."""
        self.node = node
        self._given_up: list[str] = []  # boots whose records its thread drops: no sweep waits them out
        self._wake = threading.Event()  # a renewal now: presence connected, or (unstoppable) validity ended
        pool = pool or "prefork"
        self.validity = Validity(
            node,
            boot or uuid.uuid4().hex,
            on_forfeit,
            self._given_up.append,
            stoppable=stoppable(pool),
            on_expired=self._wake.set,
        )
        self.pid = os.getpid()
        self._tokens = itertools.count()
        self.interval = settings.HEARTBEAT_SECONDS
        self.lease_seconds = settings.LEASE_SECONDS
        self.renewals = Renewals(node, self.lease_seconds)
        self.machine, self.keys = self.renewals.machine, self.renewals.keys
        # Executions give up this long before the lease may lapse: the sweep may act the moment it does.
        self.margin = settings.lease_margin()
        self.on_renewed = on_renewed
        self._stop = threading.Event()
        self.presence = Presence(node, self._wake.set, pool=pool) if settings.PRESENCE else None
        self.renewals.presence = self.presence
        self._thread: threading.Thread | None = None
        self._failing = False
        self._retry = min(FIRST_RETRY_SECONDS, self.interval)  # the wait before the next try, no lease held
        self._unprotected_since: float | None = None  # time.monotonic(): its first lease not yet taken
        self._trouble_since: float | None = None  # time.monotonic(): see trouble_seconds
        self._unreachable: str | None = None  # why take() could not reach Redis, until start() says it
        self._when_taken: list[Callable[[], None]] = []
        self._taking = threading.Lock()  # between when_taken() and the thread that takes the first lease

    @property
    def boot(self) -> str:
        return self.validity.boot

    @property
    def generation(self) -> int:
        return self.validity.generation

    @property
    def valid_until(self) -> float:
        """Until when (``clock.now()``) the executions of this boot hold; 0 while none does."""
        return self.validity.valid_until

    @property
    def lease_key(self) -> str:
        return self.keys.lease(self.node, self.boot)

    @property
    def leased(self) -> bool:
        """Whether this boot has taken its lease and not given it up: a delivery admitted now is
        recorded under it. Before the first lease is taken (its ledger could not be reached), and from a
        forfeit until the next boot's lease is taken, nothing is."""
        return self.validity.valid_until != 0.0

    @property
    def answered(self) -> bool:
        """Whether the last renewal came back: while it did not, a delivery waits for its ledger write."""
        return not self._failing

    def trouble_seconds(self) -> float:
        """How long this worker's renewals (or tries to take its first lease) have gone unanswered or been
        refused, none answered since; 0 without trouble. Deliveries are held for it (``hold.py``)."""
        since = self._trouble_since
        return 0.0 if since is None else time.monotonic() - since

    def token(self) -> str:
        """A token no other ledger entry of any boot carries: this boot's id and a count.

        Cheaper than a random one, which costs a system call on the path of every task.
        """
        return f"{self.boot}.{next(self._tokens):x}"

    def take(self) -> bool:
        """Take the lease without the thread that keeps it: a worker does so before it forks its pool
        and consumes, so that its first deliveries are admitted under the lease. A thread running while
        the pool forks could leave a lock held in the child for ever, so the beating waits for
        ``start()``, and what this renewal saw of other boots is left to the next one.

        ``False`` when Redis could not be reached: ``start()`` says so in one line (by then Celery has set
        up its logging, and a worker's log file gets the line), and its thread keeps trying quietly and
        takes the lease when Redis answers."""
        self._unprotected_since = time.monotonic()
        try:
            taken = self._renew(watching=False)
        except redis.RedisError as exc:
            self._failing = True
            self._unreachable = str(exc)
            self._trouble_since = self._unprotected_since
            return False
        return taken

    def when_taken(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once this boot holds its first lease: now, or from the thread that takes it.
        A callback asked for while that thread takes the lease runs once, from one or the other."""
        with self._taking:
            if self._unprotected_since is not None:
                self._when_taken.append(callback)
                return
        callback()

    def start(self) -> None:
        """Renew now, then keep renewing from a thread until stopped. After a ``take()`` that could not
        reach Redis, the thread alone tries again, without holding up the worker's start."""
        if self._thread is not None:
            return
        if self._unreachable is not None:
            logger.error(
                "worker %s cannot reach its ledger's Redis at %s (%s): it holds no lease, so it gives "
                "the recoverable tasks it receives back to the broker for up to %gs, then runs them "
                "unrecorded (they cannot be recovered if it dies); it keeps trying and takes its lease "
                "when Redis answers",
                self.node,
                renewal.ledger_address(),
                self._unreachable,
                settings.LEDGER_HOLD_SECONDS,
            )
        elif self.leased or self._unprotected_since is None:
            self.renew()
        if self.presence is not None:  # the pool has forked (or spawns): the connection is this process's
            self.presence.start()
        self.validity.start()
        self._thread = threading.Thread(
            target=self._run, name=f"celery-orphans-heartbeat-{self.node}", daemon=True
        )
        self._thread.start()

    def renew(self, *, watching: bool = True) -> bool:
        """Renew the lease (or take it, for a new boot); ``False`` when Redis could not be reached."""
        try:
            renewed = self._renew(watching=watching)
        except (redis.RedisError, ImproperlyConfigured) as exc:
            self.validity.expire()
            if not self._failing:
                logger.warning("cannot renew the lease of %s: %s", self.node, exc)
            self._failing = True
            self._retry = min(self.interval, 2 * self._retry)
            renewed = False
        if not renewed and self._trouble_since is None:
            self._trouble_since = time.monotonic()
        return renewed

    def _renew(self, *, watching: bool) -> bool:
        """``renew``, raising ``redis.RedisError`` when Redis could not be reached."""
        if os.getpid() != self.pid:  # a forked child must never keep its parent's lease alive
            self._stop.set()
            return False
        self.validity.tick()
        self.renewals.drop_each(self._given_up, self.time_left())
        boot, generation, held = self.validity.current()
        begun = clock.now()
        seen = self._write(boot, first=not held, watching=watching)
        if seen is None:
            self.validity.lapse(generation, "its lease is gone from Redis")
            boot, generation, _ = self.validity.current()
            begun = clock.now()
            seen = self._write(boot, first=True, watching=watching)
        # Redis set the expiry once it had the command, so no sooner than this.
        if seen is None or not self.validity.extend(generation, begun, self.lease_seconds - self.margin):
            return False
        self._retry = min(FIRST_RETRY_SECONDS, self.interval)
        self._trouble_since = None
        if self.presence is not None:
            self.presence.loss.renewed(begun)
        if self._unprotected_since is not None:
            self._first_taken(time.monotonic() - self._unprotected_since)
        elif self._failing:
            logger.info("lease of %s renewed again", self.node)
        self._failing = False
        if self.on_renewed is not None and (seen.lapsed or seen.neighbours or seen.missing):
            try:
                self.on_renewed(seen)
            except Exception:
                logger.exception("the watch of %s failed", self.node)
        return True

    def _write(self, boot: str | None = None, *, first: bool, watching: bool = True) -> leases.Seen | None:
        """Write the lease of ``boot`` (this boot's); what the renewal saw of other boots (nothing unless
        ``watching``), or ``None`` if the lease was not written."""
        limit = WATCH_LIMIT if watching and self.on_renewed is not None else 0
        return self.renewals.write(boot or self.boot, first=first, limit=limit, seconds=self.time_left())

    def time_left(self) -> float:
        """What a Redis call of the heartbeat may take: what is left of this boot's validity (a heartbeat
        while none holds). A slow answer that comes within it still counts; one that would come after it
        could not, and is not waited for. Where the clock gives nothing up (``Validity.stoppable``), an
        answer may come until about the lease's end in Redis: one that finds the lease still holds."""
        if not self.leased:
            return self.interval
        left = self.valid_until - clock.now()
        return left if self.validity.stoppable else left + self.margin

    def _first_taken(self, waited: float) -> None:
        with self._taking:
            self._unprotected_since = None
            callbacks, self._when_taken = self._when_taken, []
        if self._failing:
            logger.info(
                "lease of %s (boot %s) taken: its ledger answered after %.1fs; the "
                "recoverable tasks it receives from now on are recorded",
                self.node,
                self.boot,
                waited,
            )
        for callback in callbacks:
            try:
                callback()
            except Exception:
                logger.exception("a task of %s, once its lease was taken, failed", self.node)

    def forfeit(self, why: str) -> None:
        """Give up every execution of this boot, and start a new boot with a lease of its own."""
        self.validity.lapse(self.generation, why)

    def _run(self) -> None:
        while True:
            self._wake.wait(self._until_next())
            self._wake.clear()
            if self._stop.is_set():
                return
            self.renew()

    def _until_next(self) -> float:
        """The next beat, or sooner, at the instant this boot's executions stop holding; while no lease
        holds, the next try."""
        if not self.leased:
            return self._retry
        return max(0.0, min(self.interval, self.valid_until - clock.now()))

    def stop(self) -> None:
        """Stop beating and drop the lease, so the sweep need not wait for it to lapse."""
        self._stop.set()
        self._wake.set()
        self.validity.stop()
        if self._thread is not None:
            self._thread.join(timeout=self.interval + 1)
        try:
            with logs.redis_fault_let_go(logger, "cannot drop the lease of %s", self.node):
                if os.getpid() == self.pid and self.leased:  # else no lease of this boot to drop
                    self.renewals.drop(self.boot, self.time_left())
        finally:
            if self.presence is not None:  # after the lease: its going says nothing to the others then
                self.presence.stop()
