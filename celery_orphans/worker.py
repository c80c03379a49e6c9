"""Worker lifecycle: start the lease when a worker boots, drop it when it shuts down cleanly."""

from __future__ import annotations

import logging
from typing import Any

from django.core.exceptions import ImproperlyConfigured

from celery_orphans import leases

logger = logging.getLogger(__name__)


def on_worker_ready(sender: Any = None, **kwargs: Any) -> None:
    """``worker_ready``: the consumer is about to take tasks; make sure this boot holds a lease."""
    node = getattr(sender, "hostname", None)
    if not node:
        return
    try:
        leases.start(node)
    except ImproperlyConfigured as exc:
        logger.error("celery-orphans: worker %s runs without a lease: %s", node, exc)


def on_worker_init(sender: Any = None, **kwargs: Any) -> None:
    """``celeryd_after_setup``: start the lease before any task can be received."""
    on_worker_ready(sender=sender, **kwargs)


def on_worker_shutdown(**kwargs: Any) -> None:
    leases.stop()
