"""Make Celery tasks survive worker death."""

from __future__ import annotations

from celery_orphans.decorators import recoverable
from celery_orphans.exceptions import (
    CeleryOrphansError,
    LedgerUnavailable,
    RecoveryLimitReached,
    SweepLocked,
    TaskOrphaned,
)
from celery_orphans.recommended import recommended_celery_settings

__version__ = "0.1.0.dev0"

__all__ = [
    "CeleryOrphansError",
    "LedgerUnavailable",
    "RecoveryLimitReached",
    "SweepLocked",
    "TaskOrphaned",
    "__version__",
    "recommended_celery_settings",
    "recoverable",
]
