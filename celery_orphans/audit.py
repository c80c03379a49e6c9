"""Writing the audit log."""

from __future__ import annotations

from celery_orphans.checkpoints import Saved
from celery_orphans.models import Action as AuditAction
from celery_orphans.models import OrphanEvent, Trigger
from celery_orphans.reconcile import Action, Decision

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
) -> OrphanEvent:
    return OrphanEvent.objects.create(
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


def record_once(
    decision: Decision, *, task_name: str, worker: str, trigger: Trigger, user: str = "", shadow: bool = False
) -> OrphanEvent | None:
    """Like ``record``, unless the same action was already recorded for the task (shadow mode repeats)."""
    action = (_SHADOWED if shadow else _AUDITED)[decision.action]
    if OrphanEvent.objects.filter(task_id=decision.task_id, action=action).exists():
        return None
    return record(decision, task_name=task_name, worker=worker, trigger=trigger, user=user, shadow=shadow)
