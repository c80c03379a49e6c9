from __future__ import annotations

from django.apps import AppConfig


class CeleryOrphansConfig(AppConfig):
    name = "celery_orphans"
    verbose_name = "Celery orphans"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from celery import signals

        from celery_orphans import checks, worker

        checks.register()
        signals.worker_ready.connect(worker.on_worker_ready, dispatch_uid="celery_orphans.worker_ready")
        signals.worker_shutdown.connect(
            worker.on_worker_shutdown, dispatch_uid="celery_orphans.worker_shutdown"
        )
