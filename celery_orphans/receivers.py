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


def worker_init(sender: Any = None, **kwargs: Any) -> None:
    """Take this boot's lease before the worker consumes a message, so that every delivery is recorded
    and checked under it: on RabbitMQ, messages are handed to the worker while it subscribes, before it
    says it is ready."""
    node = getattr(sender, "hostname", None)
    if not node:
        return
    on_renewed = (
        watch.Watch(getattr(sender, "app", None)).seen if settings.ENABLED and settings.WATCH else None
    )
    try:
        heartbeat.take(node, functools.partial(_stop_executions, sender), on_renewed)
    except ImproperlyConfigured as exc:
        logger.error("celery-orphans: worker %s runs without a lease: %s", node, exc)


def _stop_executions(worker: Any, generation: int) -> int:
    # The pool is made after worker_init: look it up when a boot is given up.
    return fence.stop_executions(getattr(worker, "pool", None), generation)


def worker_ready(sender: Any = None, **kwargs: Any) -> None:
    """Keep the lease alive from now on (the pool has forked), and look for what the previous boot of
    this node name left running."""
    beat = heartbeat.current()
    if beat is None:
        return
    beat.start()
    if settings.ENABLED and settings.BOOT_SWEEP:
        boot.start(getattr(sender, "app", None), beat.node, beat.boot, timezone.now())


def worker_shutdown(**kwargs: Any) -> None:
    outbox.flush()  # the entries of tasks acknowledged just before the shutdown
    heartbeat.stop()
