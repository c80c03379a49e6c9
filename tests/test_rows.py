"""Reading STARTED rows: each row's start time exactly as stored, in the form Django gives it."""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone

import pytest
from django.utils import timezone
from django_celery_results.models import TaskResult

from celery_orphans.recovery import rows

pytestmark = pytest.mark.django_db


def started(task_id: str, at: datetime | None, *, worker: str = "w1@test") -> None:
    TaskResult.objects.create(
        task_id=task_id,
        task_name="demoapp.summarize",
        status="STARTED",
        worker=worker,
        date_started=at,
        result=json.dumps({"pid": 1, "hostname": "from-result@test"}),
    )


def test_start_times_are_read_to_the_microsecond_and_aware():
    at = datetime(2026, 11, 23, 20, 34, 10, 350865, tzinfo=dt_timezone.utc)
    started("exact", at)
    started("no-start", None, worker="")

    found = {row.task_id: row for row in rows.started_rows(None)}

    assert found["exact"].started_at == at
    assert found["exact"].started_at.tzinfo is not None
    created = TaskResult.objects.get(task_id="no-start").date_created
    assert found["no-start"].started_at == created  # no start time: its creation
    assert found["no-start"].worker == "from-result@test"  # no worker column: the result's hostname


def test_the_cutoff_keeps_only_rows_started_before_it():
    now = timezone.now()
    started("old", now - timedelta(minutes=5))
    started("new", now)

    assert [row.task_id for row in rows.started_rows(now - timedelta(minutes=1))] == ["old"]


def test_without_time_zones_start_times_are_naive_local_times(settings):
    settings.USE_TZ = False
    settings.TIME_ZONE = "Europe/Paris"
    at = datetime(2026, 7, 1, 12, 0, 0, 123456)  # naive: Paris time, as Django stores it then
    started("naive", at)

    (row,) = rows.started_rows(None)

    assert row.started_at == at
    assert TaskResult.objects.get(task_id="naive").date_started == at
