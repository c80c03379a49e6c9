"""The migrations: the beat schedule they create and remove, and no model change left without one."""

from __future__ import annotations

import importlib
import io
from collections.abc import Iterator
from datetime import datetime, timezone

import pytest
from django.core.management import call_command
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django_celery_beat.models import IntervalSchedule, PeriodicTask, PeriodicTasks

from celery_orphans.conf import settings as orphan_settings

schedule = importlib.import_module("celery_orphans.migrations.0002_beat_schedule")
BEFORE = ("celery_orphans", "0001_initial")
SCHEDULE = ("celery_orphans", "0002_beat_schedule")
EXPIRES = ("celery_orphans", "0007_beat_schedule_expires")
LONG_AGO = datetime(2000, 1, 1, tzinfo=timezone.utc)


def migrate(*targets: tuple[str, str]) -> None:
    executor = MigrationExecutor(connection)
    executor.migrate(list(targets))


def latest() -> list[tuple[str, str]]:
    return MigrationExecutor(connection).loader.graph.leaf_nodes()


@pytest.fixture
def migrator(transactional_db: None) -> Iterator[None]:
    """Lets a test move celery_orphans back and forth; the database ends fully migrated whatever happens."""
    try:
        yield
    finally:
        migrate(*latest())


def last_update() -> datetime | None:
    return PeriodicTasks.objects.filter(ident=1).values_list("last_update", flat=True).first()


def pretend_beat_last_loaded_long_ago() -> None:
    PeriodicTasks.objects.update_or_create(ident=1, defaults={"last_update": LONG_AGO})


def test_schedule_names_the_reconcile_task():
    assert schedule.TASK_NAME == "celery_orphans.reconcile"
    from celery_orphans.tasks import reconcile

    assert reconcile.name == schedule.TASK_NAME


def test_migrating_creates_an_enabled_schedule_at_the_configured_interval_and_tells_beat(migrator):
    migrate(BEFORE)
    pretend_beat_last_loaded_long_ago()

    migrate(SCHEDULE)

    task = PeriodicTask.objects.get(name=schedule.SCHEDULE_NAME)
    assert task.task == "celery_orphans.reconcile"
    assert task.enabled
    assert (task.interval.every, task.interval.period) == (orphan_settings.SWEEP_INTERVAL_SECONDS, "seconds")
    assert (task.crontab, task.solar, task.clocked) == (None, None, None)
    assert last_update() > LONG_AGO


def test_schedule_interval_comes_from_the_setting_at_migrate_time(migrator, settings):
    settings.CELERY_ORPHANS_SWEEP_INTERVAL_SECONDS = 37
    migrate(BEFORE)

    migrate(SCHEDULE)

    assert PeriodicTask.objects.get(name=schedule.SCHEDULE_NAME).interval.every == 37


def test_beat_sends_each_sweep_with_an_expiry_of_one_interval_so_waiting_sweeps_do_not_pile_up(migrator):
    from celery import current_app
    from django_celery_beat.schedulers import ModelEntry

    migrate(BEFORE)
    migrate(SCHEDULE)
    PeriodicTask.objects.filter(name=schedule.SCHEDULE_NAME).update(
        interval=IntervalSchedule.objects.create(every=7, period="seconds")
    )
    pretend_beat_last_loaded_long_ago()

    migrate(EXPIRES)

    entry = ModelEntry(PeriodicTask.objects.get(name=schedule.SCHEDULE_NAME), app=current_app)
    assert entry.options["expires"] == 7
    assert last_update() > LONG_AGO


def test_migrating_back_past_the_expiry_leaves_the_schedule_without_one(migrator):
    migrate(BEFORE)
    migrate(EXPIRES)
    expires = PeriodicTask.objects.get(name=schedule.SCHEDULE_NAME).expire_seconds
    assert expires == orphan_settings.SWEEP_INTERVAL_SECONDS

    migrate(SCHEDULE)

    assert PeriodicTask.objects.get(name=schedule.SCHEDULE_NAME).expire_seconds is None


def test_migrating_back_removes_the_schedule_and_tells_beat(migrator):
    migrate(BEFORE)
    migrate(SCHEDULE)
    assert PeriodicTask.objects.filter(name=schedule.SCHEDULE_NAME).exists()
    pretend_beat_last_loaded_long_ago()

    migrate(BEFORE)

    assert not PeriodicTask.objects.filter(name=schedule.SCHEDULE_NAME).exists()
    assert last_update() > LONG_AGO


def test_migrating_back_leaves_other_periodic_tasks_alone(migrator):
    migrate(SCHEDULE)
    every_minute = IntervalSchedule.objects.create(every=60, period="seconds")
    PeriodicTask.objects.create(name="someone else's", task="demoapp.scan", interval=every_minute)

    migrate(BEFORE)

    assert PeriodicTask.objects.filter(name="someone else's").exists()


def test_reapplying_updates_the_one_schedule_instead_of_adding_another(migrator):
    migrate(BEFORE)
    migrate(SCHEDULE)
    # Someone switched it off, then the migration ran again (after `migrate --fake` back, say).
    PeriodicTask.objects.filter(name=schedule.SCHEDULE_NAME).update(enabled=False, task="renamed")
    MigrationExecutor(connection).recorder.record_unapplied(*SCHEDULE)
    pretend_beat_last_loaded_long_ago()

    migrate(SCHEDULE)

    [task] = PeriodicTask.objects.filter(name=schedule.SCHEDULE_NAME)
    assert (task.task, task.enabled) == ("celery_orphans.reconcile", True)
    assert last_update() > LONG_AGO


def test_existing_interval_schedule_is_reused(migrator):
    migrate(BEFORE)
    existing = IntervalSchedule.objects.create(every=orphan_settings.SWEEP_INTERVAL_SECONDS, period="seconds")

    migrate(SCHEDULE)

    assert PeriodicTask.objects.get(name=schedule.SCHEDULE_NAME).interval_id == existing.pk


def test_duplicate_interval_schedules_do_not_break_the_migration(migrator):
    migrate(BEFORE)
    every = orphan_settings.SWEEP_INTERVAL_SECONDS
    IntervalSchedule.objects.bulk_create([IntervalSchedule(every=every, period="seconds") for _ in range(2)])

    try:
        migrate(SCHEDULE)
        assert PeriodicTask.objects.get(name=schedule.SCHEDULE_NAME).interval.every == every
    finally:
        # Whatever happened, let the fixture migrate forward again.
        IntervalSchedule.objects.filter(every=every, period="seconds", periodictask__isnull=True).delete()


@pytest.mark.django_db
def test_models_and_migrations_agree():
    out = io.StringIO()

    # --check exits with SystemExit(1) when a migration is missing.
    call_command("makemigrations", "celery_orphans", check_changes=True, dry_run=True, stdout=out)

    assert "No changes detected" in out.getvalue()


@pytest.mark.django_db
def test_migrating_creates_the_permission_to_lift_a_recovery_cap():
    from django.contrib.auth.models import Permission

    lift = Permission.objects.get(content_type__app_label="celery_orphans", codename="lift_recovery_cap")

    assert lift.name == "Can lift the recovery cap of a task marked terminal at it"
