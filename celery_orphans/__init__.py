"""Make Celery tasks survive worker death."""

from __future__ import annotations

from celery_orphans.checkpoints import Checkpoint, checkpoint
from celery_orphans.decorators import recoverable
from celery_orphans.exceptions import (
    CeleryOrphansError,
    CheckpointFenced,
    CheckpointTooLarge,
    LedgerUnavailable,
    RecoveryLimitReached,
    SweepLocked,
    TaskOrphaned,
)
from celery_orphans.recommended import recommended_celery_settings
from celery_orphans.signals import orphan_detected, orphan_marked_terminal, orphan_recovered

__version__ = "0.1.0.dev0"

__all__ = [
    "CeleryOrphansError",
    "Checkpoint",
    "CheckpointFenced",
    "CheckpointTooLarge",
    "LedgerUnavailable",
    "RecoveryLimitReached",
    "SweepLocked",
    "TaskOrphaned",
    "__version__",
    "checkpoint",
    "orphan_detected",
    "orphan_marked_terminal",
    "orphan_recovered",
    "recommended_celery_settings",
    "recoverable",
]
