"""The Beat-scheduled reconcile task."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from celery import shared_task

from celery_orphans import logs, sweep
from celery_orphans.choices import Trigger
from celery_orphans.conf import settings
from celery_orphans.exceptions import SweepLocked

logger = logs.get(__name__)
_said_disabled = False
SWEEP_TASK = "celery_orphans.reconcile"


class QuietSweeps(logging.Filter):
    """Keeps Beat's "Sending due task" line and a worker's "received" and "succeeded" lines of the
    Beat-scheduled sweep out of the log: it runs every few seconds (some 17,000 times a day), and logs
    its own line, at INFO when it did something and at DEBUG otherwise. Its failures are still logged."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.INFO:
            return True
        args = record.args
        if isinstance(args, Mapping):  # the worker's lines: %(name)s
            return args.get("name") != SWEEP_TASK
        return not (isinstance(args, tuple) and SWEEP_TASK in args)  # Beat's: (entry name, task name)


# The loggers Celery writes a task's receipt and its success to, and Beat each task it sends.
QUIETED = ("celery.worker.strategy", "celery.app.trace", "celery.beat")


@shared_task(name=SWEEP_TASK, ignore_result=True)
def reconcile() -> str:
    """Find orphaned tasks, recover the recoverable ones, mark the rest terminal."""
    global _said_disabled
    if not settings.ENABLED:
        if not _said_disabled:
            logger.info("CELERY_ORPHANS_ENABLED is off; the reconcile task does nothing")
            _said_disabled = True
        return "disabled"
    _said_disabled = False
    try:
        report = sweep.run(sweep.Options(trigger=Trigger.BEAT))
    except SweepLocked:
        # Routine: a worker's own sweeps (at boot, on a lapsed lease) hold it as Beat's next one arrives.
        logger.debug("another sweep holds the lock; this one did nothing")
        return "locked"
    return report.summary()
