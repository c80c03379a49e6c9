"""When a pool process dies under a recoverable task while the worker lives (typically the OOM killer).

Celery would re-queue the message (``task_reject_on_worker_lost``) with nothing to stop a task that
kills its process every time, or mark it failed. The worker's main process instead counts it as a
recovery: it sends the task again under the same cap as every other recovery, and marks it terminal
once the cap is reached.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import redis
from billiard.common import human_status
from billiard.einfo import ExceptionWithTraceback  # type: ignore[attr-defined]
from billiard.exceptions import WorkerLostError
from celery.worker.state import task_ready
from django.db import DatabaseError

from celery_orphans import logs, registry
from celery_orphans.conf import settings
from celery_orphans.decision import Decision
from celery_orphans.observations import Candidate
from celery_orphans.rules import Limits, after_pool_loss
from celery_orphans.worker import lifecycle
from celery_orphans.worker.outbox import outbox
from celery_orphans.worker.takeover import boot_ledger, take_over

logger = logs.get(__name__)
# billiard says "Worker exited prematurely: signal 9 (SIGKILL) Job: 0." of a pool process lost under a job.
_EXITED = re.compile(r"exited prematurely: (?P<status>.+?)(?: Job: \d+)?\.?$")


def exit_status(exc: BaseException) -> str | None:
    """How the pool process ended (``signal 9 (SIGKILL)``, ``exitcode 1``), where Celery says."""
    if isinstance(exc, ExceptionWithTraceback):
        exc = exc.exc
    if isinstance(exc, SystemExit):
        return str(human_status(exc.code if isinstance(exc.code, int) else 1))
    found = _EXITED.search(str(exc))
    return found.group("status") if found else None


def is_pool_loss(request: Any, exc: BaseException) -> bool:
    if isinstance(exc, ExceptionWithTraceback):
        exc = exc.exc
    lost = isinstance(exc, (WorkerLostError, SystemExit))
    return lost and not request._already_cancelled and not request._already_revoked


def recover_lost(request: Any, exc_info: Any) -> bool:
    """Recover (or close) the task of a lost pool process; ``False`` leaves it to Celery."""
    heartbeat = lifecycle.current()
    if heartbeat is None or not settings.ENABLED or settings.SHADOW_MODE:
        return False
    if not is_pool_loss(request, exc_info.exception):
        return False
    if registry.policy_of(request.task) is None:
        return False
    try:
        outbox.settle()  # the entry was sent without waiting: it is in Redis once answered
        attempts = boot_ledger(heartbeat).attempts([request.id])[request.id]
        outcome = take_over(request, heartbeat, attempts, _deciding(exit_status(exc_info.exception)))
    except (redis.RedisError, DatabaseError) as exc:
        logger.error(
            "could not take over %s[%s] after its pool process died: %s",
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


def _deciding(status: str | None) -> Callable[[Candidate, Limits], Decision]:
    """``after_pool_loss``, its detail saying how the pool process ended when that is known."""

    def decide(candidate: Candidate, limits: Limits) -> Decision:
        decision = after_pool_loss(candidate, limits)
        if status is None:
            return decision
        return dataclasses.replace(decision, detail=f"{decision.detail}; its pool process ended: {status}")

    return decide
