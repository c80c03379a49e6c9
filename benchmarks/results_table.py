"""What the benchmarks that fill django-celery-results' table share: Django over a database of their own,
and STARTED rows written into the table by COPY.

A benchmark puts the repository and the test project on ``sys.path``, then calls ``setup_django`` before
it imports anything that needs Django's apps (a model, the test project's Celery app).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

import django

from tests.services import ensure_database, provide

COLUMNS = (
    "task_id, status, content_type, content_encoding, result, date_done, traceback, meta, task_args, "
    "task_kwargs, task_name, worker, date_created, periodic_task_name, date_started"
)


def setup_django(database_url: str) -> None:
    """Django on the test project's settings over ``database_url`` (made if it is not there), with a Redis
    of the run's own (``provide``) and celery-orphans enabled."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "testproject.settings")
    provide(database_url)
    ensure_database(database_url)
    os.environ["CELERY_ORPHANS_ENABLED"] = "true"
    django.setup()


def table() -> str:
    """The results table's name."""
    from django_celery_results.models import TaskResult  # once Django is set up

    return str(TaskResult._meta.db_table)


@contextmanager
def copy_rows() -> Iterator[Any]:
    """A COPY into the results table on Django's own connection (so inside its transaction)."""
    from django.db import connection

    connection.ensure_connection()
    with (
        connection.connection.cursor() as cursor,
        cursor.copy(f"COPY {table()} ({COLUMNS}) FROM STDIN") as copy,
    ):
        yield copy


def started_row(task_id: str, name: str, worker: str, began: datetime, i: int) -> tuple[Any, ...]:
    """The ``COLUMNS`` of a STARTED row of task ``name`` begun at ``began`` on ``worker``, the ``i``-th of
    its set (its argument, and one of 50 pids)."""
    result = json.dumps({"pid": 1000 + i % 50, "hostname": worker})
    return (task_id, "STARTED", "application/json", "utf-8", result, began, None, '{"children": []}',
            f"([{i}],)", "{}", name, worker, began, None, began)  # fmt: skip


def analyze() -> None:
    """Fresh planner statistics for the results table, once its rows were written."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {table()}")
