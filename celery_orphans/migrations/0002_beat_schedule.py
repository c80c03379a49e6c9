"""Create the django-celery-beat schedule of the reconcile task."""

from typing import Any

from django.db import migrations

TASK_NAME = "celery_orphans.reconcile"
SCHEDULE_NAME = "celery-orphans: reconcile orphaned tasks"


def _interval_seconds() -> int:
    # Read here, at migrate time, never at import: a project's settings must not shape the migration.
    from celery_orphans.conf import settings

    return settings.SWEEP_INTERVAL_SECONDS


def create_schedule(apps, schema_editor):  # type: ignore[no-untyped-def]
    db = schema_editor.connection.alias
    IntervalSchedule = apps.get_model("django_celery_beat", "IntervalSchedule")
    PeriodicTask = apps.get_model("django_celery_beat", "PeriodicTask")
    PeriodicTasks = apps.get_model("django_celery_beat", "PeriodicTasks")
    # The table allows equal rows (django-celery-beat itself copes with that): reuse the first.
    every = _interval_seconds()
    equal = IntervalSchedule.objects.using(db).filter(every=every, period="seconds")
    interval = equal.order_by("pk").first() or equal.create(every=every, period="seconds")
    PeriodicTask.objects.using(db).update_or_create(
        name=SCHEDULE_NAME,
        defaults={
            "task": TASK_NAME,
            "interval": interval,
            "enabled": True,
            "description": "Recover or close tasks whose worker died (celery-orphans).",
        },
    )
    _bump(PeriodicTasks, db)


def remove_schedule(apps, schema_editor):  # type: ignore[no-untyped-def]
    db = schema_editor.connection.alias
    PeriodicTask = apps.get_model("django_celery_beat", "PeriodicTask")
    PeriodicTasks = apps.get_model("django_celery_beat", "PeriodicTasks")
    PeriodicTask.objects.using(db).filter(name=SCHEDULE_NAME).delete()
    _bump(PeriodicTasks, db)


def _bump(PeriodicTasks: Any, db: str) -> None:
    # Historical models skip PeriodicTask.save(), which is what normally tells a running beat to reload.
    from django.utils import timezone

    PeriodicTasks.objects.using(db).update_or_create(ident=1, defaults={"last_update": timezone.now()})


class Migration(migrations.Migration):
    dependencies = [
        ("celery_orphans", "0001_initial"),
        ("django_celery_beat", "0018_improve_crontab_helptext"),
    ]

    operations = [migrations.RunPython(create_schedule, remove_schedule)]
