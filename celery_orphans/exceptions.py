"""Exceptions raised or recorded by celery-orphans."""

from __future__ import annotations

from celery.exceptions import Ignore


class CeleryOrphansError(Exception):
    """Base class for errors raised by celery-orphans."""


class SweepLocked(CeleryOrphansError):
    """Another reconcile sweep holds the lock; this one did nothing."""


class LedgerUnavailable(CeleryOrphansError):
    """Redis/Valkey could not be reached, so the sweep stopped rather than act without a count."""


class CheckpointTooLarge(CeleryOrphansError, ValueError):
    """A checkpoint was larger than ``CELERY_ORPHANS_CHECKPOINT_MAX_BYTES``; nothing was saved."""


class CheckpointFenced(CeleryOrphansError, Ignore):
    """A newer execution of the task owns its id now; this one must stop.

    Raised by ``Checkpoint.save()``. It is a Celery ``Ignore``, so left uncaught it ends the stale
    execution without writing a result or sending ``task_failure`` over the newer execution's state.
    """


class ExecutionForfeit(CeleryOrphansError, Ignore):
    """The execution's worker did not renew its lease in time, so the task may be recovered elsewhere.

    Raised inside a forfeit execution when its body returns or raises, or when it retries. It is a
    Celery ``Ignore``: the execution ends without storing a result or applying its chain's next link.
    """


class TaskOrphaned(Exception):
    """Stored as the result of an orphaned task that was not re-run.

    Its message names the worker that lost the task and why it was not recovered.
    """


class RecoveryLimitReached(TaskOrphaned):
    """Stored as the result of an orphaned task that already used all its recoveries."""
