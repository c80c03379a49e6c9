"""Worker lifecycle: hold a lease while the worker lives, and recover its previous boot's tasks at boot."""

from __future__ import annotations

import logging
import threading
import time
from datetime import datetime
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.db import close_old_connections
from django.utils import timezone

from celery_orphans import leases
from celery_orphans.conf import settings
from celery_orphans.exceptions import CeleryOrphansError, SweepLocked

logger = logging.getLogger(__name__)
BOOT_SWEEP_TRIES = 10


def on_worker_ready(sender: Any = None, **kwargs: Any) -> None:
    """``worker_ready``: take a lease for this boot, then look for what the previous boot left."""
    node = getattr(sender, "hostname", None)
    if not node:
        return
    try:
        beat = leases.start(node)
    except ImproperlyConfigured as exc:
        logger.error("celery-orphans: worker %s runs without a lease: %s", node, exc)
        return
    if settings.ENABLED and settings.BOOT_SWEEP:
        app = getattr(sender, "app", None)
        threading.Thread(
            target=boot_sweep,
            args=(app, beat, timezone.now()),
            name="celery-orphans-boot-sweep",
            daemon=True,
        ).start()


def on_worker_shutdown(**kwargs: Any) -> None:
    from celery_orphans.outbox import outbox

    outbox.flush()  # the entries of tasks acknowledged just before the shutdown
    leases.stop()


def _held_now() -> frozenset[str]:
    from celery.worker import state

    return frozenset(state.requests)


def boot_sweep(app: Any, beat: leases.Heartbeat, booted_at: datetime) -> None:
    """Recover the tasks an earlier boot of this node name left behind, without waiting for Beat.

    Their process is gone by definition, unless another live process uses the same name: then the
    tasks are left to the regular sweep, which asks the workers.
    """
    from celery_orphans import sweep
    from celery_orphans.candidates import BootScope
    from celery_orphans.models import Trigger

    others = leases.fresh_boots([beat.node]).get(beat.node, frozenset()) - {beat.boot}
    # A boot killed a moment ago still has a lease; a live twin renews its lease within a heartbeat.
    others = leases.renewed_within(beat.node, others, 2 * settings.HEARTBEAT_SECONDS + 0.5)
    if others:
        logger.warning(
            "celery-orphans: another live worker holds the name %s (boots %s); two workers share a name, "
            "so their tasks are left to the regular sweep",
            beat.node,
            ", ".join(sorted(others)),
        )
        return
    scope = BootScope(beat.node, beat.boot, booted_at, _held_now)
    options = sweep.Options(trigger=Trigger.WORKER_BOOT, grace_seconds=0, boot=scope)
    try:
        for _ in range(BOOT_SWEEP_TRIES):
            try:
                report = sweep.run(options, app)
            except SweepLocked:
                time.sleep(1)
                continue
            if report.outcomes:
                logger.info("celery-orphans: boot sweep of %s: %s", beat.node, report.summary())
            return
        logger.info("celery-orphans: boot sweep of %s gave way to other sweeps", beat.node)
    except (CeleryOrphansError, ImproperlyConfigured) as exc:
        logger.error("celery-orphans: boot sweep of %s failed: %s", beat.node, exc)
    finally:
        close_old_connections()
