"""The record of what was done: a row in the audit log, and the signals once it is committed."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.apps import apps
from django.db import DatabaseError, transaction
from django.dispatch import Signal
from django.utils import timezone

from celery_orphans import logs
from celery_orphans.checkpoints import Saved
from celery_orphans.choices import AuditAction, Trigger
from celery_orphans.decision import Action, Decision
from celery_orphans.recovery.outcome import Outcome
from celery_orphans.signals import orphan_detected, orphan_marked_terminal, orphan_recovered

logger = logs.get(__name__)


def _events() -> Any:
    # The model, looked up when it is needed: this module is imported before Django's apps are ready.
    return apps.get_model("celery_orphans", "OrphanEvent")


_AUDITED = {
    Action.RECOVER: AuditAction.RECOVERED,
    Action.MARK_TERMINAL: AuditAction.MARKED_TERMINAL,
    Action.FORGET: AuditAction.FORGOTTEN,
    Action.REPORT: AuditAction.REPORTED,
}
_SHADOWED = {
    Action.RECOVER: AuditAction.WOULD_RECOVER,
    Action.MARK_TERMINAL: AuditAction.WOULD_MARK_TERMINAL,
    Action.FORGET: AuditAction.WOULD_FORGET,
    Action.REPORT: AuditAction.REPORTED,  # reporting changes nothing: the same in shadow mode
}


def _write(
    action: AuditAction,
    task_id: str,
    *,
    reason: str,
    trigger: Trigger,
    user: str = "",
    task_name: str = "",
    worker: str = "",
    **more: Any,
) -> Any:
    """One audit row, the names cut to their columns; ``more``: the other columns it fills."""
    return _events().objects.create(
        task_id=task_id,
        task_name=task_name[:255],
        worker=worker[:255],
        action=action,
        reason=reason,
        trigger=trigger,
        triggered_by=user[:150],
        **more,
    )


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
    return _write(
        (_SHADOWED if shadow else _AUDITED)[decision.action],
        decision.task_id,
        reason=decision.reason.value,
        evidence=decision.evidence.value,
        detail=decision.detail,
        attempt=decision.attempt,
        trigger=trigger,
        user=user,
        task_name=task_name,
        worker=worker,
        checkpoint_saved_at=checkpoint.at if checkpoint else None,
        checkpoint_bytes=checkpoint.size if checkpoint else None,
    )


def record_event(
    action: AuditAction,
    *,
    reason: str,
    trigger: Trigger,
    user: str = "",
    detail: str = "",
    task_id: str = "",
    task_name: str = "",
    worker: str = "",
) -> Any:
    """A row that records no action taken on a task: a refusal, a failure, a sweep with nothing to do.

    Written in a savepoint of its own, so a database fault here leaves a surrounding transaction usable;
    that fault is logged, never raised: the record of a refusal must not turn it into another error.
    """
    try:
        with transaction.atomic():
            return _write(
                action,
                task_id[:255],
                reason=reason[:64],
                detail=detail,
                trigger=trigger,
                user=user,
                task_name=task_name,
                worker=worker,
            )
    except DatabaseError as exc:
        logger.error(
            "could not write the audit row of a %s (%s, by %s): %s", action, reason, user or trigger, exc
        )
        return None


def record_failure(decision: Decision, detail: str, *, task_name: str, worker: str, trigger: Trigger,
                   user: str = "") -> Any:  # fmt: skip
    """An action on a task that could not be carried out; the sweep stopped there."""
    return record_event(
        AuditAction.FAILED, reason=decision.reason.value, detail=f"{detail}; the sweep stopped here",
        trigger=trigger, user=user, task_id=decision.task_id, task_name=task_name, worker=worker,
    )  # fmt: skip


def refused_lately(user: str, reason: str, seconds: float) -> bool:
    """Whether a refusal of ``user`` for ``reason`` was recorded in the last ``seconds``."""
    since = timezone.now() - timedelta(seconds=seconds)
    found = _events().objects.filter(
        action=AuditAction.REFUSED, reason=reason, triggered_by=user[:150], created_at__gte=since
    )
    return bool(found.exists())


def record_lift(
    task_id: str, *, task_name: str, worker: str, attempts: int, detail: str, trigger: Trigger, user: str
) -> Any:
    """An operator lifted the recovery cap of a task marked terminal at it (in the lift's transaction)."""
    return _write(
        AuditAction.CAP_LIFTED,
        task_id,
        reason="by_operator",
        detail=detail,
        attempt=attempts,
        trigger=trigger,
        user=user,
        task_name=task_name,
        worker=worker,
    )


def record_duplicate(task_id: str, task_name: str, worker: str, running_on: str) -> Any:
    """A worker dropped a delivery of a task that an execution on ``running_on`` runs and is alive."""
    return _write(
        AuditAction.DUPLICATE_DROPPED,
        task_id,
        reason="duplicate",
        evidence="owner_alive",
        detail=f"delivered again while it runs on {running_on}; the delivery was dropped",
        trigger=Trigger.WORKER,
        task_name=task_name,
        worker=worker,
    )


def record_once(
    decision: Decision, *, task_name: str, worker: str, trigger: Trigger, user: str = "", shadow: bool = False
) -> Any:
    """Like ``record``, unless the same action was already recorded for the task (shadow mode repeats)."""
    action = (_SHADOWED if shadow else _AUDITED)[decision.action]
    # Once per task and person: an operator's shadow run is recorded under their name, even after Beat's.
    if _events().objects.filter(task_id=decision.task_id, action=action, triggered_by=user[:150]).exists():
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
                "a receiver of a celery-orphans signal raised for task %s: %r (%s)",
                arguments["task_id"],
                result,
                getattr(receiver, "__qualname__", receiver),
            )
