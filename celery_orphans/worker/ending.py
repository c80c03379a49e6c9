"""In the pool process: record an execution that ended without writing a state (``endings.py``)."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

from celery import states

from celery_orphans import endings, logs
from celery_orphans.store import Keys, client

logger = logs.get(__name__)

# The states Celery's trace gives a body that ended without storing one: ``Ignore`` (and so
# ``Task.replace()``) and ``Reject``.
STATELESS = frozenset({states.IGNORED, states.REJECTED})
WAIT_SECONDS = 2.0


def on_task_postrun(
    sender: Any = None, task_id: str | None = None, state: str | None = None, **_: Any
) -> None:
    if state not in STATELESS or sender is None or task_id is None:
        return
    request = sender.request
    if request.is_eager or not _has_started_row(sender, request):
        return
    # Recorded before the outcome reaches the worker's main process (a pool process reports it after this
    # signal): from then on the node no longer holds the task and a recoverable task's entry goes, so a
    # sweep could judge the row. A slow ledger holds the ending up for WAIT_SECONDS at most.
    args = (sender.name, task_id, state, str(request.hostname), _ttl(sender))
    writer = threading.Thread(target=_record, args=args, name="celery-orphans-ending", daemon=True)
    writer.start()
    writer.join(WAIT_SECONDS)


def _record(name: str, task_id: str, state: str, node: str, ttl: int) -> None:
    # On a fault its row may be judged orphaned: its worker no longer holds the task.
    with logs.redis_fault_let_go(logger, "cannot record that %s[%s] ended %s", name, task_id, state):
        endings.write(client(), Keys.current(), task_id, node, ttl)


def _has_started_row(task: Any, request: Any) -> bool:
    return bool(task.track_started) and not (task.ignore_result or request.ignore_result)


def _ttl(task: Any) -> int:
    expires = task.app.conf.result_expires
    if isinstance(expires, timedelta):
        return int(expires.total_seconds()) or endings.DEFAULT_TTL_SECONDS
    return int(expires) if expires else endings.DEFAULT_TTL_SECONDS
