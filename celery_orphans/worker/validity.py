"""Until when the executions a worker boot admitted hold, and the thread that gives them up at that instant.

A renewal of the lease is sent at ``sent_at``; Redis sets the key's expiry once it has the command, so no
sooner. The executions of the boot hold until ``sent_at + lease - margin`` (``conf.Settings.lease_margin``),
computed when the renewal is sent, not when its reply arrives: a reply that comes after that instant does
not revive them. At that instant the deadline thread gives them up by the clock alone, without waiting for
any Redis call, and the pool processes, which read the same instant from shared memory (``forfeit.py``), stop
their own executions even if this process is frozen.

Where nothing can stop a running execution (the solo and threads pools: ``stoppable=False``), giving it up
by the clock would only hand its task to another worker while its body runs on. There the instant passing
asks for a renewal at once (``on_expired``) instead: one that finds the lease still in Redis makes the
generation hold again (no sweep can judge a boot whose lease is there), and one that finds it gone, or
cannot reach Redis, gives the generation up.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Callable
from typing import Any

from celery_orphans import logs
from celery_orphans.conf import FORFEIT_LATENCY_SECONDS
from celery_orphans.worker import clock, forfeit

logger = logs.get(__name__)

# The pools whose executions run in the worker's own threads, by Celery's names for them and their classes.
UNSTOPPABLE_POOLS = frozenset(
    {"solo", "threads", "celery.concurrency.solo:TaskPool", "celery.concurrency.thread:TaskPool"}
)


# The pool whose executions run in processes of their own, each watching for itself (``watchdog.py``).
PREFORK_POOLS = frozenset({"prefork", "celery.concurrency.prefork:TaskPool"})


def _name(pool_cls: Any) -> str:
    if isinstance(pool_cls, str):  # a name is not imported: a green pool's module needs its event loop
        return pool_cls
    return f"{getattr(pool_cls, '__module__', '')}:{getattr(pool_cls, '__qualname__', '')}"


def stoppable(pool_cls: Any) -> bool:
    """Whether a worker running ``pool_cls`` (a class or Celery's name for one) can stop a running
    execution: not on the solo and threads pools, whose executions run in the worker's own threads."""
    return _name(pool_cls) not in UNSTOPPABLE_POOLS


def self_watching(pool_cls: Any) -> bool:
    """Whether a worker running ``pool_cls`` runs its executions in processes that stop them even while
    its main process is frozen or stalled: the prefork pool's (``watchdog.py``)."""
    return _name(pool_cls) in PREFORK_POOLS


class Validity:
    """The boot a worker process runs as, the generation of its executions, and until when they hold.

    When a generation is given up, ``stop(generation)`` stops its running executions (and says how many
    it stopped), and ``given_up(boot)`` hears which boot's records are now to be dropped from Redis.
    Unless ``stoppable``, the instant passing calls ``on_expired()`` instead of giving anything up."""

    def __init__(
        self,
        node: str,
        boot: str,
        stop: Callable[[int], int] | None,
        given_up: Callable[[str], None],
        *,
        stoppable: bool = True,
        on_expired: Callable[[], None] | None = None,
    ) -> None:
        self.node = node
        self.stoppable = stoppable
        self._on_expired = on_expired
        self.boot = boot
        self.generation = 1
        self.valid_until = 0.0  # clock.now(); 0: no renewal holds (none yet, or given up since)
        self._stop_executions = stop
        self._given_up = given_up
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()

    def current(self) -> tuple[str, int, bool]:
        """The boot and the generation a renewal sent now renews, and whether that boot holds its lease
        (else the renewal takes it)."""
        with self._lock:
            return self.boot, self.generation, self.valid_until != 0.0

    def extend(self, generation: int, sent_at: float, hold: float) -> bool:
        """A renewal of ``generation`` sent at ``sent_at`` was answered: its executions hold until
        ``sent_at + hold``. ``False``, and nothing extended, if the generation was given up meanwhile or
        its validity ran out before the answer came (it is given up now, unless ``stoppable`` is off: the
        renewal found the lease still there)."""
        with self._lock:
            if generation != self.generation:
                return False
            if not self.stoppable or not self._expired():
                self.valid_until = sent_at + hold
                forfeit.hold_until(generation, self.valid_until, by_clock=self.stoppable)
                return True
        self.lapse(generation, "its lease was renewed too late", if_expired=True)
        return False

    def lapse(self, generation: int, why: str, *, if_expired: bool = False) -> bool:
        """Give ``generation`` up now, if it is still the current one (and, ``if_expired``, its validity
        ran out): a new boot id, a new generation that holds once a renewal of the new boot is answered.
        ``False`` if it was not given up."""
        with self._lock:
            if generation != self.generation or (if_expired and not self._expired()):
                return False
            old_boot = self.boot
            self.generation += 1
            self.valid_until = 0.0
            forfeit.withdraw(self.generation)
            self.boot = new_boot = uuid.uuid4().hex
        stopped = self._stop_executions(generation) if self._stop_executions is not None else 0
        logger.error(
            "worker %s gives up its boot %s (%s): %s running executions are forfeit and "
            "will be recovered from the ledger; it goes on as boot %s",
            self.node,
            old_boot,
            why,
            stopped,
            new_boot,
        )
        self._given_up(old_boot)
        return True

    def expire(self) -> bool:
        """Give the current generation up if its validity ran out; whether it did. (A presence connection's
        loss pauses its executions instead, ``forfeit.pauses``: the lease alone gives them up.)"""
        return self.lapse(self.generation, "its lease was not renewed in time", if_expired=True)

    def tick(self) -> bool:
        """What the clock alone does: ``expire()``, or, unless ``stoppable``, ask for a renewal once the
        validity ran out. Whether the generation was given up."""
        if self.stoppable:
            return self.expire()
        if self._expired() and self._on_expired is not None:
            self._on_expired()
        return False

    def _expired(self) -> bool:
        return self.valid_until != 0.0 and clock.now() >= self.valid_until

    def start(self) -> None:
        """Watch the clock from a thread of this process, until ``stop``."""
        if self._thread is None:
            forfeit.main_alive()
            self._thread = threading.Thread(target=self._run, name="celery-orphans-deadline", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        # Sliced waits: a step of the clock, or a suspend, is seen within a slice.
        while not self._stop.wait(FORFEIT_LATENCY_SECONDS):
            if os.getpid() != self._pid:
                return
            forfeit.main_alive()  # the pool processes look past a main process that stops saying this
            self.tick()
            forfeit.settle_paused()

    def stop(self) -> None:
        self._stop.set()
