"""The watch: a worker starts a sweep itself the moment its heartbeat sees another boot gone.

Every renewal reads the boots whose lease lapsed and the processes of the boots on the same machine
(``scripts.RENEW``). A lapsed boot is taken off the watch by one of the workers that saw it, and a
process seen to exit is recorded by one (``leases.claim_lapsed``, ``leases.record_exit``); that worker
runs a sweep at once, in a thread of its own, instead of leaving the dead boot's tasks to the next
sweep of Beat's schedule, which still runs as before.
"""

from __future__ import annotations

import logging
import threading
import time

import redis
from celery import Celery
from django.core.exceptions import ImproperlyConfigured
from django.db import close_old_connections

from celery_orphans import leases, processes
from celery_orphans.choices import Trigger
from celery_orphans.exceptions import CeleryOrphansError, SweepLocked
from celery_orphans.sweep.runner import run
from celery_orphans.sweep.values import Options

logger = logging.getLogger(__name__)
LOCKED_WAIT_SECONDS = 0.25  # between tries while another sweep holds the lock
LOCKED_TRIES = 40  # then the sweep that holds it, or the next of Beat's, judges what was seen


class Watch:
    """Hears what each renewal of one worker saw, and sweeps when a boot is gone."""

    def __init__(self, app: Celery | None) -> None:
        self.app = app
        self._lock = threading.Lock()
        self._running = False
        self._again = False

    def seen(self, seen: leases.Seen) -> None:
        """Called by the heartbeat after a renewal that saw lapsed boots or other boots on its machine."""
        try:
            gone = [
                f"{node} (boot {boot}): its lease lapsed"
                for node, boot in seen.lapsed
                if leases.claim_lapsed(node, boot)
            ]
            gone += [
                f"{node} (boot {boot}): its process {process.pid} exited"
                for node, boot, process in seen.neighbours
                if processes.exited(process) and leases.record_exit(node, boot, process)
            ]
        except redis.RedisError as exc:
            logger.warning("celery-orphans: the watch cannot reach Redis: %s", exc)
            return
        if gone:
            logger.info("celery-orphans: worker gone, sweeping now: %s", "; ".join(gone))
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
        try:
            for _ in range(LOCKED_TRIES):
                try:
                    run(Options(trigger=Trigger.WATCH), self.app)
                except SweepLocked:
                    time.sleep(LOCKED_WAIT_SECONDS)
                    continue
                return
            logger.info("celery-orphans: the watch's sweep gave way to other sweeps")
        except (CeleryOrphansError, ImproperlyConfigured) as exc:
            logger.error("celery-orphans: the watch's sweep failed: %s", exc)
        except Exception:
            logger.exception("celery-orphans: the watch's sweep failed")
        finally:
            close_old_connections()
