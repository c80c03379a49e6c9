"""Exceptions raised or recorded by celery-orphans."""

from __future__ import annotations


class CeleryOrphansError(Exception):
    """Base class for errors raised by celery-orphans."""


class SweepLocked(CeleryOrphansError):
    """Another reconcile sweep holds the lock; this one did nothing."""


class LedgerUnavailable(CeleryOrphansError):
    """Redis/Valkey could not be reached, so the sweep stopped rather than act without a count."""


class TaskOrphaned(Exception):
    """Stored as the result of an orphaned task that was not re-run.

    Its message names the worker that lost the task and why it was not recovered.
    """


class RecoveryLimitReached(TaskOrphaned):
    """Stored as the result of an orphaned task that already used all its recoveries."""
