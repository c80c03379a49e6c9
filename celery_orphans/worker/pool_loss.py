"""When a pool process dies under a recoverable task while the worker lives (typically the OOM killer).

Celery would re-queue the message (``task_reject_on_worker_lost``) with nothing to stop a task that
kills its process every time, or mark it failed. The worker's main process instead counts it as a
recovery: it sends the task again under the same cap as every other recovery, and marks it terminal
once the cap is reached.
"""

from __future__ import annotations

import logging
from typing import Any

import redis
from billiard.einfo import ExceptionWithTraceback  # type: ignore[attr-defined]
from billiard.exceptions import WorkerLostError
from celery.worker.state import task_ready
from django.db import DatabaseError

from celery_orphans import registry
from celery_orphans.conf import settings
from celery_orphans.reconcile import after_pool_loss
from celery_orphans.worker import heartbeat
from celery_orphans.worker.outbox import outbox
from celery_orphans.worker.takeover import boot_ledger, take_over

logger = logging.getLogger(__name__)


def is_pool_loss(request: Any, exc: BaseException) -> bool:
    if isinstance(exc, ExceptionWithTraceback):
        exc = exc.exc
    lost = isinstance(exc, (WorkerLostError, SystemExit))
    return lost and not request._already_cancelled and not request._already_revoked


def recover_lost(request: Any, exc_info: Any) -> bool:
    """Recover (or close) the task of a lost pool process; ``False`` leaves it to Celery."""
    beat = heartbeat.current()
    if beat is None or not settings.ENABLED or settings.SHADOW_MODE:
        return False
    if not is_pool_loss(request, exc_info.exception):
        return False
    if registry.policy_of(request.task) is None:
        return False
    try:
        outbox.settle()  # the entry was sent without waiting: it is in Redis once answered
        attempts = boot_ledger(beat).attempts([request.id])[request.id]
        outcome = take_over(request, beat, attempts, after_pool_loss)
    except (redis.RedisError, DatabaseError) as exc:
        logger.error(
            "celery-orphans: could not take over %s[%s] after its pool process died: %s",
            request.name,
            request.id,
            exc,
        )
        return False
    if not outcome.done:
        return False
    task_ready(request)
    request.acknowledge()
    return True
