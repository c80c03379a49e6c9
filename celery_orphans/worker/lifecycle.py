"""This worker process's heartbeat, one a process: taken at ``worker_init``, kept alive from the
moment the pool has started (``receivers.PoolStarted``), stopped at ``worker_shutdown``; ``current()``
finds it from anywhere in the process."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from celery_orphans import leases, logs
from celery_orphans.worker.heartbeat import Heartbeat

logger = logs.get(__name__)

_current: Heartbeat | None = None


def current() -> Heartbeat | None:
    """The heartbeat of this worker process, if it runs one."""
    return _current if _current is not None and _current.pid == os.getpid() else None


def take(
    node: str,
    on_forfeit: Callable[[int], int] | None = None,
    on_renewed: Callable[[leases.Seen], None] | None = None,
    *,
    pool: Any = None,
) -> Heartbeat:
    """Take this process's lease, not yet kept alive (``Heartbeat.take``); ``on_forfeit(generation)``
    stops the executions of a boot given up, ``on_renewed(seen)`` hears what a renewal saw of other
    boots, ``pool`` is the worker's pool (``Heartbeat``). Its Redis out of reach, the
    heartbeat is kept and takes the lease once started and answered; ``ImproperlyConfigured`` (no usable
    Redis URL) keeps none."""
    global _current
    heartbeat = current()
    if heartbeat is None:
        heartbeat = Heartbeat(node, on_forfeit=on_forfeit, on_renewed=on_renewed, pool=pool)
        if heartbeat.take():
            logger.info("lease of %s (boot %s) taken", node, heartbeat.boot)
        _current = heartbeat
    return heartbeat


def stop() -> None:
    """Stop this process's heartbeat, if it runs one, and drop its lease."""
    global _current
    heartbeat, _current = current(), None
    if heartbeat is not None:
        heartbeat.stop()
