"""The tasks of the ledger hygiene benchmark: ``@recoverable`` tasks that end every way a task can end.

Same Celery app and settings as the throughput benchmark (our recommended settings, django-db results).

    celery -A benchmarks.hygiene_app worker -P prefork -c 2
"""

from __future__ import annotations

import time
from typing import Any

from benchmarks.throughput_app import app
from celery_orphans import checkpoint, recoverable

__all__ = ["app"]


@recoverable
@app.task(name="bench.hygiene.succeed", bind=True)
def succeed(self: Any, save: bool) -> int:
    """Succeeds; with ``save``, after saving a checkpoint (which its success must remove)."""
    if save:
        checkpoint(self).save(1)
    return 1


@recoverable
@app.task(name="bench.hygiene.fail", bind=True)
def fail(self: Any, save: bool) -> None:
    if save:
        checkpoint(self).save(1)
    raise ValueError("fails on purpose")


@recoverable
@app.task(name="bench.hygiene.retry", bind=True, max_retries=1, default_retry_delay=0)
def retry(self: Any, save: bool) -> int:
    """Retries once (a new message under the same id), then succeeds."""
    if save:
        checkpoint(self).save(self.request.retries)
    if self.request.retries == 0:
        raise self.retry(countdown=0)
    return 1


@recoverable
@app.task(name="bench.hygiene.soft_limit", bind=True, soft_time_limit=0.05)
def soft_limit(self: Any, save: bool) -> None:
    """Overruns its soft time limit: the exception ends it as a failure."""
    if save:
        checkpoint(self).save(1)
    time.sleep(1)  # SoftTimeLimitExceeded is raised here


@recoverable
@app.task(name="bench.hygiene.hard_limit", bind=True, time_limit=0.2)
def hard_limit(self: Any, save: bool) -> None:
    """Overruns its hard time limit: the pool process running it is killed."""
    if save:
        checkpoint(self).save(1)
    time.sleep(5)
