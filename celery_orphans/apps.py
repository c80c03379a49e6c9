from __future__ import annotations

import logging

from django.apps import AppConfig


class CeleryOrphansConfig(AppConfig):
    name = "celery_orphans"
    verbose_name = "Celery orphans"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from celery import signals

        from celery_orphans import checks, receivers, tasks
        from celery_orphans.worker import (
            checkpoint,
            control,  # noqa: F401 - registers the remote revoke command
            ending,
        )

        checks.register()
        for name in tasks.QUIETED:
            logging.getLogger(name).addFilter(tasks.QuietSweeps())
        signals.worker_init.connect(receivers.worker_init, dispatch_uid="celery_orphans.worker_init")
        signals.worker_before_create_process.connect(
            receivers.worker_before_create_process,
            dispatch_uid="celery_orphans.worker_before_create_process",
        )
        signals.worker_ready.connect(receivers.worker_ready, dispatch_uid="celery_orphans.worker_ready")
        signals.worker_shutdown.connect(
            receivers.worker_shutdown, dispatch_uid="celery_orphans.worker_shutdown"
        )
        # First of the receivers a project may add: a forfeit execution stores nothing, runs nothing.
        signals.task_prerun.connect(receivers.task_prerun, dispatch_uid="celery_orphans.task_prerun")
        signals.task_postrun.connect(receivers.task_postrun, dispatch_uid="celery_orphans.task_end")
        # A finished task's checkpoint goes; a Celery retry sends task_retry, never task_failure.
        signals.task_success.connect(checkpoint.on_task_success, dispatch_uid="celery_orphans.task_success")
        signals.task_failure.connect(checkpoint.on_task_failure, dispatch_uid="celery_orphans.task_failure")
        signals.task_revoked.connect(checkpoint.on_task_revoked, dispatch_uid="celery_orphans.task_revoked")
        # Ignore (so replace()) and Reject store no state: the row they leave is no running task's.
        signals.task_postrun.connect(ending.on_task_postrun, dispatch_uid="celery_orphans.task_postrun")
