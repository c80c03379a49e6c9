"""Make Celery tasks survive worker death.

The public API is imported on first use, so ``import celery_orphans`` (in a settings module, for
``recommended_celery_settings``) loads nothing that needs Django's apps to be ready.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # where each public name lives, for type checkers (a test checks it)
    from celery_orphans.checkpoints import (
        Execution as Execution,
    )
    from celery_orphans.decorators import (
        recoverable as recoverable,
    )
    from celery_orphans.exceptions import (
        CeleryOrphansError as CeleryOrphansError,
    )
    from celery_orphans.exceptions import (
        CheckpointFenced as CheckpointFenced,
    )
    from celery_orphans.exceptions import (
        CheckpointTooLarge as CheckpointTooLarge,
    )
    from celery_orphans.exceptions import (
        ExecutionForfeit as ExecutionForfeit,
    )
    from celery_orphans.exceptions import (
        LedgerUnavailable as LedgerUnavailable,
    )
    from celery_orphans.exceptions import (
        RecoveryLimitReached as RecoveryLimitReached,
    )
    from celery_orphans.exceptions import (
        SweepLocked as SweepLocked,
    )
    from celery_orphans.exceptions import (
        TaskOrphaned as TaskOrphaned,
    )
    from celery_orphans.recommended import (
        recommended_celery_settings as recommended_celery_settings,
    )
    from celery_orphans.signals import (
        orphan_detected as orphan_detected,
    )
    from celery_orphans.signals import (
        orphan_marked_terminal as orphan_marked_terminal,
    )
    from celery_orphans.signals import (
        orphan_recovered as orphan_recovered,
    )
    from celery_orphans.worker.checkpoint import (
        Checkpoint as Checkpoint,
    )
    from celery_orphans.worker.checkpoint import (
        checkpoint as checkpoint,
    )
    from celery_orphans.worker.checkpoint import (
        execution as execution,
    )

__version__ = "0.1.0.dev0"

# The public names, each with the module it lives in (tests/test_public_api.py checks that the
# TYPE_CHECKING imports above name the same).
_HOMES = {
    "Checkpoint": "worker.checkpoint",
    "Execution": "checkpoints",
    "execution": "worker.checkpoint",
    "checkpoint": "worker.checkpoint",
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

__all__ = ["__version__", *_HOMES]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'celery_orphans' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"celery_orphans.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})
