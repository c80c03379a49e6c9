"""The watch: a worker starts a sweep itself the moment it learns that another boot is gone.

Every renewal reads the boots whose lease lapsed and the processes of the boots on the same machine
(``scripts.RENEW``). The processes of this machine are followed between renewals too: the kernel says
the instant one exits (``processes.Exits``), and the renewal's own check is the fallback where it cannot.
A lapsed boot is taken off the watch by one of the workers that saw it, and a process seen to exit is
recorded by one (``leases.claim_lapsed``, ``leases.record_exit``); that worker runs a sweep at once, in a
thread of its own, instead of leaving the dead boot's tasks to the next sweep of Beat's schedule, which
still runs as before.
"""

from __future__ import annotations

import contextlib
import threading

from celery import Celery

from celery_orphans import leases, logs, processes
from celery_orphans.choices import Trigger
from celery_orphans.sweep.background import sweep_giving_way
from celery_orphans.sweep.values import Options

logger = logs.get(__name__)

Neighbour = tuple[str, str, processes.Process]  # node, boot, its process


class Watch:
    """Hears what each renewal of one worker saw, and the exits of its neighbours; sweeps when a boot is
    gone."""

    def __init__(self, app: Celery | None) -> None:
        self.app = app
        self._lock = threading.Lock()
        self._running = False
        self._again = False
        self._exits: processes.Exits[Neighbour] = processes.Exits(self._exited)
        self._missing: dict[tuple[str, str], threading.Timer] = {}  # boots whose presence is missing

    def seen(self, seen: leases.Seen) -> None:
        """Called by the heartbeat after a renewal that saw lapsed boots or other boots on its machine."""
        exited = {n for n in seen.neighbours if processes.exited(n[2])}
        self._exits.follow({n: n[2] for n in seen.neighbours if n not in exited})
        for node, boot, left in seen.missing:
            self._follow_presence(node, boot, left)
        gone: list[str] = []  # none on a fault, even those claimed before it
        with _unreachable():
            lapsed = [
                f"{node} (boot {boot}): its lease lapsed"
                for node, boot in seen.lapsed
                if leases.claim_lapsed(node, boot)
            ]
            gone = lapsed + [_recorded(n) for n in exited if leases.record_exit(*n)]
        self._gone(gone)

    def _exited(self, neighbour: Neighbour) -> None:
        """The kernel says the process of ``neighbour`` exited (``processes.Exits``' thread)."""
        recorded = False
        with _unreachable():
            recorded = leases.record_exit(*neighbour)
        self._gone([_recorded(neighbour)] if recorded else [])

    def _follow_presence(self, node: str, boot: str, left: float) -> None:
        """The presence of ``boot`` is missing: judge it once its wait is over (``leases.claim_presence_lost``
        records it only if the boot has not renewed since, nor subscribed again)."""
        with self._lock:
            if (node, boot) in self._missing:
                return
            # A little after the wait ends by Redis's clock: a claim a moment early is refused.
            timer = threading.Timer(left + 0.05, self._presence_over, args=(node, boot))
            timer.daemon = True
            self._missing[(node, boot)] = timer
        timer.start()

    def _presence_over(self, node: str, boot: str) -> None:
        recorded = False
        try:
            with _unreachable():
                recorded = leases.claim_presence_lost(node, boot)
        finally:
            with self._lock:
                self._missing.pop((node, boot), None)
        self._gone([f"{node} (boot {boot}): its presence connection closed"] if recorded else [])

    def _gone(self, gone: list[str]) -> None:
        if gone:
            logger.info("worker gone, sweeping now: %s", "; ".join(gone))
            self.sweep()

    def sweep(self) -> None:
        """Sweep in a thread of its own; if one runs already, it sweeps once more when it is done."""
        with self._lock:
            if self._running:
                self._again = True
                return
            self._running = True
        threading.Thread(target=self._sweeps, name="celery-orphans-watch-sweep", daemon=True).start()

    def _sweeps(self) -> None:
        while True:
            self._sweep_once()
            with self._lock:
                if not self._again:
                    self._running = False
                    return
                self._again = False

    def _sweep_once(self) -> None:
        sweep_giving_way("the watch's sweep", lambda: Options(trigger=Trigger.WATCH), self.app)


def _unreachable() -> contextlib.AbstractContextManager[None]:
    return logs.redis_fault_let_go(logger, "the watch cannot reach Redis")


def _recorded(neighbour: Neighbour) -> str:
    node, boot, process = neighbour
    return f"{node} (boot {boot}): its process {process.pid} exited"
