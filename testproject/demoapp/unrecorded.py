"""A recoverable task without a result row, for the tests that need one.

Not imported by the app's autodiscovery, so the test project's checks stay quiet (it is warning W004): a
worker imports it with ``-I demoapp.unrecorded``, a test by importing it.
"""

from typing import Any

from celery import shared_task

from celery_orphans import recoverable
from demoapp.tasks import _record, _sleep_steps


@recoverable
@shared_task(bind=True, name="demoapp.fire", ignore_result=True)
def fire(self: Any, seconds: float = 0.0) -> None:
    """Recoverable without a result row: only the ledger knows it runs."""
    _record(self.request.id, "start")
    _sleep_steps(seconds)
    _record(self.request.id, "finish")
