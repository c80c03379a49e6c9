"""What celery-orphans does on Celery's signals; ``apps.py`` connects them, and each hands off at once."""

from __future__ import annotations

import functools
from typing import Any

from celery import bootsteps
from django.core.exceptions import ImproperlyConfigured
from django.utils import timezone

from celery_orphans import logs, preflight
from celery_orphans.conf import settings
from celery_orphans.sweep import boot, watch
from celery_orphans.worker import forfeit, handover, lifecycle
from celery_orphans.worker.outbox import outbox

logger = logs.get(__name__)


def worker_init(sender: Any = None, **kwargs: Any) -> None:
    """Stop a worker whose configuration the checks reject (``preflight``); else take this boot's lease
    before the worker consumes a message, so that every delivery is recorded and checked under it: on
    RabbitMQ, messages are handed to the worker while it subscribes, before it says it is ready."""
    node = getattr(sender, "hostname", None)
    if not node:
        return
    preflight.check_worker(node)
    on_renewed = (
        watch.Watch(getattr(sender, "app", None)).seen if settings.ENABLED and settings.WATCH else None
    )
    try:
        heartbeat = lifecycle.take(
            node,
            functools.partial(_stop_executions, sender),
            on_renewed,
            pool=getattr(sender, "pool_cls", None),
        )
    except ImproperlyConfigured as exc:
        logger.error("worker %s runs without a lease: %s", node, exc)
        return
    steps = getattr(getattr(sender, "app", None), "steps", None)
    if steps is not None:  # read when the worker's blueprint is made, just after this signal
        steps["worker"].add(PoolStarted)
    if heartbeat.leased and getattr(sender, "pool_start_method", "fork") != "fork":
        # Its pool processes are spawned, never forked, so the heartbeat's threads may run from now on:
        # they keep the lease through the pool's start, which a spawned pool makes slow.
        heartbeat.start()


def _stop_executions(worker: Any, generation: int) -> int:
    # The pool is made after worker_init: look it up when a boot is given up.
    return forfeit.stop_executions(getattr(worker, "pool", None), generation)


class PoolStarted(bootsteps.StartStopStep):
    """A worker bootstep: the heartbeat's threads start the moment the pool has started (a prefork pool
    has forked all its processes, an embedded Beat its process), before the consumer connects, mingles
    and subscribes. Until then nothing renews the lease taken at ``worker_init``, and on RabbitMQ
    messages are admitted under it before the worker says it is ready: a start slower than the lease's
    validity had them forfeit, and their lease lapse, on arrival."""

    requires = ("celery.worker.components:Pool", "celery.worker.components:Beat")

    def start(self, parent: Any) -> None:
        heartbeat = lifecycle.current()
        if heartbeat is not None:
            heartbeat.start()


def worker_before_create_process(sender: Any = None, **kwargs: Any) -> None:
    """The prefork pool is about to make a process: hand it the validity's memory (``handover.py``)."""
    handover.before_create_process(sender)


def worker_ready(sender: Any = None, **kwargs: Any) -> None:
    """Keep the lease alive from now on, if ``PoolStarted`` has not (a worker made without this
    app's steps), and look for what the previous boot of this node name left running."""
    heartbeat = lifecycle.current()
    if heartbeat is None:
        return
    heartbeat.start()
    if settings.ENABLED and settings.BOOT_SWEEP:
        # It needs the ledger: a worker that could not reach it at start sweeps once it holds its lease.
        booted_at, boot_id = timezone.now(), heartbeat.boot
        heartbeat.when_taken(
            lambda: boot.sweep_in_background(getattr(sender, "app", None), heartbeat.node, boot_id, booted_at)
        )


def task_prerun(sender: Any = None, task: Any = None, **kwargs: Any) -> None:
    """Before Celery stores ``STARTED`` and runs the body: a forfeit execution does neither."""
    if task is not None:
        forfeit.before_start(task)


def task_postrun(sender: Any = None, task: Any = None, **kwargs: Any) -> None:
    if task is not None:
        forfeit.after_run(task)


def worker_shutdown(**kwargs: Any) -> None:
    outbox.flush()  # the entries of tasks acknowledged just before the shutdown
    lifecycle.stop()
