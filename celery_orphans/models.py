"""The audit log: one row for every action the reconcile took (or would have taken, in shadow mode)."""

from __future__ import annotations

from django.db import models

from celery_orphans.choices import AuditAction, Trigger

__all__ = ["AuditAction", "OrphanEvent", "Trigger"]


class OrphanEvent(models.Model):
    """Something the reconcile did to an orphaned task, and the evidence that decided it."""

    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    task_id = models.CharField(max_length=255, db_index=True)
    task_name = models.CharField(max_length=255, blank=True)
    worker = models.CharField(max_length=255, blank=True)
    action = models.CharField(max_length=32, choices=AuditAction.choices)
    reason = models.CharField(max_length=64)
    evidence = models.CharField(max_length=64, blank=True)
    detail = models.TextField(blank=True)
    attempt = models.PositiveIntegerField(null=True, blank=True)
    trigger = models.CharField(max_length=32, choices=Trigger.choices)
    triggered_by = models.CharField(max_length=150, blank=True)
    checkpoint_saved_at = models.DateTimeField(
        null=True, blank=True, help_text="When the recovered task last saved a checkpoint; empty if never."
    )
    checkpoint_bytes = models.PositiveIntegerField(
        null=True, blank=True, help_text="Size of that checkpoint, in bytes of JSON."
    )

    class Meta:
        ordering = ("-created_at", "-id")
        verbose_name = "orphan event"
        permissions = (
            ("recover_orphans", "Can recover or mark orphaned tasks terminal"),
            ("view_status", "Can read the status endpoint"),
            ("lift_recovery_cap", "Can lift the recovery cap of a task marked terminal at it"),
        )

    def __str__(self) -> str:
        return f"{self.get_action_display()} {self.task_name or '?'}[{self.task_id}]"
