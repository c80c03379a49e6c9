"""The Beat-scheduled reconcile task."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from celery import shared_task

from celery_orphans import sweep
from celery_orphans.choices import Trigger
from celery_orphans.conf import settings
from celery_orphans.exceptions import SweepLocked

logger = logging.getLogger(__name__)
_said_disabled = False
SWEEP_TASK = "celery_orphans.reconcile"


class QuietSweeps(logging.Filter):
    """Keeps Celery's "received" and "succeeded" lines of the Beat-scheduled sweep out of the log: it
    runs every few seconds, and logs its own line, at INFO when it did something and at DEBUG otherwise.
    Its failures are still logged."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        return not (
            record.levelno <= logging.INFO and isinstance(args, Mapping) and args.get("name") == SWEEP_TASK
        )


# The loggers Celery writes a task's receipt and its success to.
QUIETED = ("celery.worker.strategy", "celery.app.trace")


@shared_task(name=SWEEP_TASK, ignore_result=True)
def reconcile() -> str:
    """Find orphaned tasks, recover the recoverable ones, mark the rest terminal."""
    global _said_disabled
    if not settings.ENABLED:
        if not _said_disabled:
            logger.info("celery-orphans: CELERY_ORPHANS_ENABLED is off; the reconcile task does nothing")
            _said_disabled = True
        return "disabled"
    _said_disabled = False
    try:
        report = sweep.run(sweep.Options(trigger=Trigger.BEAT))
    except SweepLocked:
        logger.info("celery-orphans: another sweep holds the lock; this one did nothing")
        return "locked"
    return report.summary()
