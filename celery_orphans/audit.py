"""Writing the audit log."""

from __future__ import annotations

from celery_orphans.models import Action as AuditAction
from celery_orphans.models import OrphanEvent, Trigger
from celery_orphans.reconcile import Action, Decision

_AUDITED = {
    Action.RECOVER: AuditAction.RECOVERED,
    Action.MARK_TERMINAL: AuditAction.MARKED_TERMINAL,
    Action.FORGET: AuditAction.FORGOTTEN,
}


def record(
    decision: Decision, *, task_name: str, worker: str, trigger: Trigger, user: str = ""
) -> OrphanEvent:
    return OrphanEvent.objects.create(
        task_id=decision.task_id,
        task_name=task_name[:255],
        worker=worker[:255],
        action=_AUDITED[decision.action],
        reason=decision.reason.value,
        evidence=decision.evidence.value,
        detail=decision.detail,
        attempt=decision.attempt,
        trigger=trigger,
        triggered_by=user[:150],
    )
