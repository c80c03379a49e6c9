"""The record of what was done: a row in the audit log, and the signals once it is committed."""

from __future__ import annotations

import logging
from typing import Any

from django.apps import apps
from django.db import transaction
from django.dispatch import Signal

from celery_orphans.checkpoints import Saved
from celery_orphans.choices import AuditAction, Trigger
from celery_orphans.reconcile import Action, Decision
from celery_orphans.signals import orphan_detected, orphan_marked_terminal, orphan_recovered
from celery_orphans.sweep.values import Outcome

logger = logging.getLogger(__name__)


def _events() -> Any:
    # The model, looked up when it is needed: this module is imported before Django's apps are ready.
    return apps.get_model("celery_orphans", "OrphanEvent")


_AUDITED = {
    Action.RECOVER: AuditAction.RECOVERED,
    Action.MARK_TERMINAL: AuditAction.MARKED_TERMINAL,
    Action.FORGET: AuditAction.FORGOTTEN,
}
_SHADOWED = {
    Action.RECOVER: AuditAction.WOULD_RECOVER,
    Action.MARK_TERMINAL: AuditAction.WOULD_MARK_TERMINAL,
    Action.FORGET: AuditAction.WOULD_FORGET,
}


def record(
    decision: Decision,
    *,
    task_name: str,
    worker: str,
    trigger: Trigger,
    user: str = "",
    shadow: bool = False,
    checkpoint: Saved | None = None,
) -> Any:
    return _events().objects.create(
        task_id=decision.task_id,
        task_name=task_name[:255],
        worker=worker[:255],
        action=(_SHADOWED if shadow else _AUDITED)[decision.action],
        reason=decision.reason.value,
        evidence=decision.evidence.value,
        detail=decision.detail,
        attempt=decision.attempt,
        trigger=trigger,
        triggered_by=user[:150],
        checkpoint_saved_at=checkpoint.at if checkpoint else None,
        checkpoint_bytes=checkpoint.size if checkpoint else None,
    )


def record_duplicate(task_id: str, task_name: str, worker: str, running_on: str) -> Any:
    """A worker dropped a delivery of a task that an execution on ``running_on`` runs and is alive."""
    return _events().objects.create(
        task_id=task_id,
        task_name=task_name[:255],
        worker=worker[:255],
        action=AuditAction.DUPLICATE_DROPPED,
        reason="duplicate",
        evidence="owner_alive",
        detail=f"delivered again while it runs on {running_on}; the delivery was dropped",
        trigger=Trigger.WORKER,
    )


def record_once(
    decision: Decision, *, task_name: str, worker: str, trigger: Trigger, user: str = "", shadow: bool = False
) -> Any:
    """Like ``record``, unless the same action was already recorded for the task (shadow mode repeats)."""
    action = (_SHADOWED if shadow else _AUDITED)[decision.action]
    if _events().objects.filter(task_id=decision.task_id, action=action).exists():
        return None
    return record(decision, task_name=task_name, worker=worker, trigger=trigger, user=user, shadow=shadow)


def recovery_recorded(task_id: str, attempt: int, since: float) -> bool:
    """Whether recovery ``attempt`` of the task was recorded after ``since`` (a Unix time)."""
    return task_id in recorded_recoveries({task_id: (attempt, since)})


def recorded_recoveries(wanted: dict[str, tuple[int, float]]) -> set[str]:
    """Of ``{task_id: (attempt, since)}``, the tasks whose recovery ``attempt`` was recorded after ``since``.

    ``since`` (when the recovered execution began) keeps an old row of the same attempt number, from
    before the fence expired and the count began again, from counting.
    """
    found = (
        _events()
        .objects.filter(task_id__in=list(wanted), action=AuditAction.RECOVERED)
        .values_list("task_id", "attempt", "created_at")
    )
    return {
        task_id
        for task_id, attempt, created_at in found
        if attempt == wanted[task_id][0] and created_at.timestamp() >= wanted[task_id][1]
    }


_FOLLOW_UP = {Action.RECOVER: orphan_recovered, Action.MARK_TERMINAL: orphan_marked_terminal}


def announce(outcome: Outcome, trigger: Trigger) -> None:
    """Send the signals for an action once the transaction it belongs to commits."""
    follow_up = _FOLLOW_UP.get(outcome.decision.action)
    if follow_up is None:
        return
    d = outcome.decision
    arguments: dict[str, Any] = {
        "task_id": d.task_id,
        "task_name": outcome.task_name,
        "worker": outcome.worker,
        "evidence": d.evidence.value,
        "reason": d.reason.value,
        "attempt": d.attempt,
        "trigger": str(trigger),
    }

    def send_both() -> None:
        _send(orphan_detected, arguments)
        _send(follow_up, arguments)

    transaction.on_commit(send_both)


def _send(signal: Signal, arguments: dict[str, Any]) -> None:
    for receiver, result in signal.send_robust(sender=_events(), **arguments):
        if isinstance(result, Exception):
            logger.error(
                "celery-orphans: a receiver of a celery-orphans signal raised for task %s: %r (%s)",
                arguments["task_id"],
                result,
                getattr(receiver, "__qualname__", receiver),
            )
