"""When a pool process dies under a recoverable task while the worker lives (typically the OOM killer).

Celery would re-queue the message (``task_reject_on_worker_lost``) with nothing to stop a task that
kills its process every time, or mark it failed. The worker's main process instead counts it as a
recovery: it sends the task again under the same cap as every other recovery, and marks it terminal
once the cap is reached.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import redis
from billiard.einfo import ExceptionWithTraceback  # type: ignore[attr-defined]
from billiard.exceptions import WorkerLostError
from celery.worker.state import task_ready
from django.db import DatabaseError
from django.utils import timezone

from celery_orphans import actions, leases, registry
from celery_orphans.conf import settings
from celery_orphans.models import Trigger
from celery_orphans.outbox import outbox
from celery_orphans.reconcile import Candidate, Decision, Policy, after_pool_loss
from celery_orphans.request import entry_for, ledger

if TYPE_CHECKING:
    from celery_orphans.sweep import Outcome

logger = logging.getLogger(__name__)


def is_pool_loss(request: Any, exc: BaseException) -> bool:
    if isinstance(exc, ExceptionWithTraceback):
        exc = exc.exc
    lost = isinstance(exc, (WorkerLostError, SystemExit))
    return lost and not request._already_cancelled and not request._already_revoked


def take_over(request: Any, exc_info: Any) -> bool:
    """Recover (or close) the task of a lost pool process; ``False`` leaves it to Celery."""
    beat = leases.current()
    if beat is None or not settings.ENABLED or settings.SHADOW_MODE:
        return False
    if not is_pool_loss(request, exc_info.exception):
        return False
    if registry.policy_of(request.task) is None:
        return False
    try:
        outbox.settle()  # the entry was sent without waiting: it is in Redis once answered
        attempts = ledger().attempts([request.id])[request.id]
        outcome = act(request, beat, attempts, after_pool_loss)
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


def act(
    request: Any,
    beat: leases.Heartbeat,
    attempts: int,
    decide: Callable[[Candidate, Policy], Decision],
    lost_on: str | None = None,
) -> Outcome:
    """Decide about a recoverable task this worker's main process holds, and carry it out as the worker.

    ``attempts`` is the fence's recovery count the decision starts from; ``lost_on`` the node whose run
    of the task was lost, when it was another worker's.
    """
    policy = registry.policy_of(request.task)
    assert policy is not None  # only recoverable tasks get this request class
    entry = entry_for(request, beat, request._orphans_token)
    candidate = Candidate(
        task_id=request.id,
        task_name=request.name,
        worker=lost_on or beat.node,
        boot=beat.boot,
        started_at=timezone.now(),
        row_status=None,
        has_entry=True,
        attempts=attempts,
        recoverable=True,
        group=policy.group,
        max_attempts=policy.max_attempts,
        content_type=entry.delivery.content_type,
    )
    decision = decide(
        candidate,
        Policy(
            now=timezone.now(),
            grace=timedelta(0),
            max_attempts=settings.MAX_ATTEMPTS,
            groups=settings.GROUPS,
        ),
    )
    from celery_orphans.sweep import Options, Outcome

    executor = actions.Executor(request.task.app, ledger(), Options(trigger=Trigger.WORKER), timezone.now())
    try:
        return executor.carry_out(Outcome(decision, request.name, lost_on or beat.node), candidate, entry)
    finally:
        executor.close()
