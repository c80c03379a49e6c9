"""The boot sweep: a booting worker recovers what an earlier boot of its node name left running.

It does not wait for Beat. Those tasks' process is gone by definition, unless another live process uses
the same name: then they are left to the regular sweep, which asks the workers.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import datetime

from celery import Celery
from celery.worker import state
from django.core.exceptions import ImproperlyConfigured
from django.db import close_old_connections

from celery_orphans import leases
from celery_orphans.choices import Trigger
from celery_orphans.conf import settings
from celery_orphans.exceptions import CeleryOrphansError, SweepLocked
from celery_orphans.sweep.runner import run
from celery_orphans.sweep.values import BootScope, Options

logger = logging.getLogger(__name__)
TRIES = 10  # sweeps that hold the lock, one second apart, before the boot sweep gives way


def start(app: Celery | None, node: str, boot: str, booted_at: datetime) -> None:
    """Run the boot sweep of ``node``'s boot ``boot`` in a thread of its own."""
    threading.Thread(
        target=sweep_at_boot,
        args=(app, node, boot, booted_at),
        name="celery-orphans-boot-sweep",
        daemon=True,
    ).start()


def _held_now() -> frozenset[str]:
    return frozenset(state.requests)


def sweep_at_boot(app: Celery | None, node: str, boot: str, booted_at: datetime) -> None:
    """Recover the tasks an earlier boot of ``node`` left behind."""
    others = leases.fresh_boots([node]).get(node, frozenset()) - {boot}
    # A boot killed a moment ago still has a lease; a live twin renews its lease within a heartbeat.
    others = leases.renewed_within(node, others, 2 * settings.HEARTBEAT_SECONDS + 0.5)
    if others:
        logger.warning(
            "celery-orphans: another live worker holds the name %s (boots %s); two workers share a name, "
            "so their tasks are left to the regular sweep",
            node,
            ", ".join(sorted(others)),
        )
        return
    options = Options(
        trigger=Trigger.WORKER_BOOT, grace_seconds=0, boot=BootScope(node, boot, booted_at, _held_now)
    )
    try:
        for _ in range(TRIES):
            try:
                report = run(options, app)
            except SweepLocked:
                time.sleep(1)
                continue
            if report.outcomes:
                logger.info("celery-orphans: boot sweep of %s: %s", node, report.summary())
            return
        logger.info("celery-orphans: boot sweep of %s gave way to other sweeps", node)
    except (CeleryOrphansError, ImproperlyConfigured) as exc:
        logger.error("celery-orphans: boot sweep of %s failed: %s", node, exc)
    finally:
        close_old_connections()
