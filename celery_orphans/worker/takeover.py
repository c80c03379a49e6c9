"""The worker decides about a recoverable task its main process holds, and carries the decision out.

Both cases where the worker, not a sweep, sees an orphan come here: its pool process died under the task
(``pool_loss``), or the broker delivered the message of a lost execution again (``redelivery``). The
decision is the pure one (``reconcile``); carrying it out is the sweep's executor, run as the worker.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from django.utils import timezone

from celery_orphans import registry
from celery_orphans.choices import Trigger
from celery_orphans.conf import settings
from celery_orphans.decision import Decision
from celery_orphans.entry import Entry, delivery_from_message
from celery_orphans.ledger import Ledger, ledger_for
from celery_orphans.observations import Candidate
from celery_orphans.recovery.executor import Executor
from celery_orphans.recovery.outcome import Outcome
from celery_orphans.rules import Limits
from celery_orphans.worker.heartbeat import Heartbeat


@functools.lru_cache(maxsize=4)
def boot_ledger(heartbeat: Heartbeat) -> Ledger:
    """The ledger of one worker boot: where its lease lives, found once rather than for every task."""
    return ledger_for(heartbeat.keys)


def entry_for(request: Any, heartbeat: Heartbeat, token: str) -> Entry:
    """The ledger entry of a request this worker boot is about to run (or ran)."""
    return Entry(
        task_id=request.id,
        task_name=request.name,
        node=heartbeat.node,
        boot=heartbeat.boot,
        recorded_at=time.time(),
        delivery=delivery_from_message(request.message),
        token=token,
    )


def take_over(
    request: Any,
    heartbeat: Heartbeat,
    attempts: int,
    decide: Callable[[Candidate, Limits], Decision],
    lost_on: str | None = None,
) -> Outcome:
    """Decide about ``request`` with ``decide`` and carry the decision out as the worker.

    ``attempts`` is the fence's recovery count the decision starts from; ``lost_on`` the node whose run
    of the task was lost, when it was another worker's.
    """
    policy = registry.policy_of(request.task)
    assert policy is not None  # only recoverable tasks get the recoverable request class
    entry = entry_for(request, heartbeat, request._orphans_token)
    candidate = Candidate(
        task_id=request.id,
        task_name=request.name,
        worker=lost_on or heartbeat.node,
        boot=heartbeat.boot,
        started_at=timezone.now(),
        row_status=None,
        has_entry=True,
        attempts=attempts,
        recoverable=True,
        group=policy.group,
        max_attempts=policy.max_attempts,
        content_type=entry.delivery.content_type,
    )
    limits = Limits(
        now=timezone.now(), grace=timedelta(0), max_attempts=settings.MAX_ATTEMPTS, groups=settings.GROUPS
    )
    decision = decide(candidate, limits)
    executor = Executor(request.task.app, boot_ledger(heartbeat), Trigger.WORKER, timezone.now())
    try:
        return executor.carry_out(
            Outcome(decision, request.name, lost_on or heartbeat.node), candidate, entry
        )
    finally:
        executor.close()
