"""What celery-orphans does on Celery's signals; ``apps.py`` connects them, and each hands off at once."""

from __future__ import annotations

import functools
import logging
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.utils import timezone

from celery_orphans.conf import settings
from celery_orphans.sweep import boot, watch
from celery_orphans.worker import fence, heartbeat
from celery_orphans.worker.outbox import outbox

logger = logging.getLogger(__name__)


def worker_ready(sender: Any = None, **kwargs: Any) -> None:
    """Take a lease for this boot, then look for what the previous boot of this name left."""
    node = getattr(sender, "hostname", None)
    if not node:
        return
    app = getattr(sender, "app", None)
    on_renewed = watch.Watch(app).seen if settings.ENABLED and settings.WATCH else None
    try:
        beat = heartbeat.start(
            node, functools.partial(fence.stop_executions, getattr(sender, "pool", None)), on_renewed
        )
    except ImproperlyConfigured as exc:
        logger.error("celery-orphans: worker %s runs without a lease: %s", node, exc)
        return
    if settings.ENABLED and settings.BOOT_SWEEP:
        boot.start(app, beat.node, beat.boot, timezone.now())


def worker_shutdown(**kwargs: Any) -> None:
    outbox.flush()  # the entries of tasks acknowledged just before the shutdown
    heartbeat.stop()
