"""Let the sweep's Beat message expire after one interval: a sweep that waited in a busy queue longer
than that is replaced by the next one, instead of the waiting ones running in a burst."""

import importlib

from django.db import migrations

schedule = importlib.import_module("celery_orphans.migrations.0002_beat_schedule")


def expire_after_one_interval(apps, schema_editor):  # type: ignore[no-untyped-def]
    db = schema_editor.connection.alias
    PeriodicTask = apps.get_model("django_celery_beat", "PeriodicTask")
    for task in PeriodicTask.objects.using(db).filter(name=schedule.SCHEDULE_NAME, expire_seconds=None):
        every = task.interval.every if task.interval and task.interval.period == "seconds" else None
        task.expire_seconds = every or schedule._interval_seconds()
        task.save(update_fields=["expire_seconds"])
    schedule._bump(apps.get_model("django_celery_beat", "PeriodicTasks"), db)


def never_expire(apps, schema_editor):  # type: ignore[no-untyped-def]
    db = schema_editor.connection.alias
    PeriodicTask = apps.get_model("django_celery_beat", "PeriodicTask")
    PeriodicTask.objects.using(db).filter(name=schedule.SCHEDULE_NAME).update(expire_seconds=None)
    schedule._bump(apps.get_model("django_celery_beat", "PeriodicTasks"), db)


class Migration(migrations.Migration):
    dependencies = [
        ("celery_orphans", "0006_audit_trigger_watch"),
        ("django_celery_beat", "0018_improve_crontab_helptext"),
    ]

    operations = [migrations.RunPython(expire_after_one_interval, never_expire)]
