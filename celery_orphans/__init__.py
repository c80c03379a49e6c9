"""Make Celery tasks survive worker death.

The public API is imported on first use, so ``import celery_orphans`` (in a settings module, for
``recommended_celery_settings``) loads nothing that needs Django's apps to be ready.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from celery_orphans.checkpoints import Checkpoint, Execution, checkpoint, execution
    from celery_orphans.decorators import recoverable
    from celery_orphans.exceptions import (
        CeleryOrphansError,
        CheckpointFenced,
        CheckpointTooLarge,
        ExecutionForfeit,
        LedgerUnavailable,
        RecoveryLimitReached,
        SweepLocked,
        TaskOrphaned,
    )
    from celery_orphans.recommended import recommended_celery_settings
    from celery_orphans.signals import orphan_detected, orphan_marked_terminal, orphan_recovered

__version__ = "0.1.0.dev0"

_HOMES = {
    "Checkpoint": "checkpoints",
    "Execution": "checkpoints",
    "execution": "checkpoints",
    "checkpoint": "checkpoints",
    "recoverable": "decorators",
    "CeleryOrphansError": "exceptions",
    "CheckpointFenced": "exceptions",
    "CheckpointTooLarge": "exceptions",
    "ExecutionForfeit": "exceptions",
    "LedgerUnavailable": "exceptions",
    "RecoveryLimitReached": "exceptions",
    "SweepLocked": "exceptions",
    "TaskOrphaned": "exceptions",
    "recommended_celery_settings": "recommended",
    "orphan_detected": "signals",
    "orphan_marked_terminal": "signals",
    "orphan_recovered": "signals",
}

__all__ = [
    "CeleryOrphansError",
    "Checkpoint",
    "CheckpointFenced",
    "CheckpointTooLarge",
    "Execution",
    "ExecutionForfeit",
    "LedgerUnavailable",
    "RecoveryLimitReached",
    "SweepLocked",
    "TaskOrphaned",
    "__version__",
    "checkpoint",
    "execution",
    "orphan_detected",
    "orphan_marked_terminal",
    "orphan_recovered",
    "recommended_celery_settings",
    "recoverable",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'celery_orphans' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"celery_orphans.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})
