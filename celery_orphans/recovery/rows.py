"""Reading and moving django-celery-results ``TaskResult`` rows.

Writes are single conditional UPDATEs of the columns that change, never a full save: a full save (as the
result backend does without a request) would blank the row's name, arguments and worker.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from datetime import timezone as dt_timezone
from typing import Any

from celery import states
from django.apps import apps
from django.conf import settings as django_settings
from django.db import connections
from django.db.models import Expression, FloatField, Func, Q, QuerySet
from django.db.models.functions import Coalesce
from django.utils import timezone

from celery_orphans.exceptions import RecoveryLimitReached, TaskOrphaned

_FIELDS = ("task_id", "task_name", "status", "worker")


def _results() -> Any:
    # The model, looked up when it is needed: this module is imported before Django's apps are ready.
    return apps.get_model("django_celery_results", "TaskResult")


@dataclass(frozen=True)
class Row:
    task_id: str
    task_name: str | None
    status: str
    worker: str | None
    started_at: datetime | None
    problem: str | None = None


def started_rows(cutoff: datetime | None, only: Iterable[str] | None = None) -> list[Row]:
    """STARTED rows whose task started before ``cutoff``, or all of them (rows without a start time use
    their creation)."""
    query = _results().objects.filter(status=states.STARTED)
    if cutoff is not None:
        query = query.filter(
            Q(date_started__lte=cutoff) | Q(date_started__isnull=True, date_created__lte=cutoff)
        )
    if only is not None:
        query = query.filter(task_id__in=list(only))
    return list(_rows(query).values())


def rows_by_id(task_ids: Iterable[str]) -> dict[str, Row]:
    ids = list(task_ids)
    if not ids:
        return {}
    return _rows(_results().objects.filter(task_id__in=ids))


def _rows(query: QuerySet[Any]) -> dict[str, Row]:
    # Without the model's ORDER BY date_done and without the ``result`` text, which only a row that
    # lacks its ``worker`` needs (read for those alone): half the time of the full row on a large table.
    values = list(query.order_by().values_list(*_FIELDS, _started(query.db)))
    nameless = [task_id for task_id, _, _, worker, _ in values if not worker]
    results = dict(
        _results().objects.filter(task_id__in=nameless).order_by().values_list("task_id", "result")
        if nameless
        else ()
    )
    aware = django_settings.USE_TZ
    return {
        str(task_id): Row(
            task_id=str(task_id),
            task_name=str(name) if name else None,
            status=str(status),
            worker=str(worker) if worker else _hostname(results.get(task_id)),
            started_at=_moment(started, aware),
        )
        for task_id, name, status, worker, started in values
    }


def _started(using: str) -> Expression:
    """When the task started (its creation if it has no start time); on PostgreSQL as seconds since
    the epoch, which psycopg reads as a float in C, where each ``timestamptz`` goes through Django's
    time zone loader in Python: most of the time of reading ten thousand rows."""
    started = Coalesce("date_started", "date_created")
    if connections[using].vendor != "postgresql":
        return started
    return Func(
        started, template="EXTRACT(EPOCH FROM %(expressions)s)::double precision", output_field=FloatField()
    )


def _moment(started: object, aware: bool) -> datetime | None:
    if isinstance(started, float):
        moment = datetime.fromtimestamp(started, tz=dt_timezone.utc)
        return moment if aware else timezone.make_naive(moment)
    return started if isinstance(started, datetime) else None


def _hostname(result: object) -> str | None:
    """The node name a STARTED row keeps in its result (``{"pid": ..., "hostname": ...}``)."""
    if not isinstance(result, str):
        return None
    try:
        meta = json.loads(result)
    except ValueError:
        return None
    hostname = meta.get("hostname") if isinstance(meta, dict) else None
    return hostname if isinstance(hostname, str) and hostname else None


def _exception_json(exc: BaseException) -> str:
    # The shape Celery's JSON result encoding gives an exception, so AsyncResult re-raises it.
    return json.dumps(
        {"exc_type": type(exc).__name__, "exc_message": list(exc.args), "exc_module": type(exc).__module__}
    )


def _move(rows: Any, status: str, exc: BaseException, detail: str) -> int:
    """Move ``rows`` (a queryset of result rows) to ``status``; returns how many rows moved."""
    moved = rows.update(
        status=status,
        result=_exception_json(exc),
        content_type="application/json",
        content_encoding="utf-8",
        traceback=detail,
        date_done=timezone.now(),
    )
    return int(moved)


def _unfinished(task_id: str) -> Any:
    return _results().objects.filter(task_id=task_id).exclude(status__in=states.READY_STATES)


def _ended(task_id: str) -> Any:
    return _results().objects.filter(task_id=task_id, status__in=states.READY_STATES)


def finished(task_id: str) -> bool:
    """Whether the task's row says it ended (the worker wrote its outcome)."""
    return bool(_ended(task_id).exists())


def ended_as(task_id: str) -> str | None:
    """The state of the task's row if it says the task ended (``SUCCESS``, ``FAILURE``, ``REVOKED``)."""
    status: str | None = _ended(task_id).values_list("status", flat=True).first()
    return status


def mark_retry(task_id: str, detail: str) -> int:
    """The task was sent again: it is no longer running, and not finished either."""
    return _move(_unfinished(task_id), states.RETRY, TaskOrphaned(detail), detail)


def mark_failure(task_id: str, detail: str, *, limit_reached: bool) -> int:
    exc = RecoveryLimitReached(detail) if limit_reached else TaskOrphaned(detail)
    return _move(_unfinished(task_id), states.FAILURE, exc, detail)


def reopen(task_id: str, detail: str) -> int:
    """An operator lifted the cap of a task marked ``FAILURE`` at it: the row says it will be sent again
    (``RETRY``, as a recovery leaves it), so the sweep that recovers it does not take it for finished."""
    failed = _results().objects.filter(task_id=task_id, status=states.FAILURE)
    return _move(failed, states.RETRY, TaskOrphaned(detail), detail)
