"""The Celery settings celery-orphans is designed around."""

from __future__ import annotations

from typing import Any

DEFAULT_VISIBILITY_TIMEOUT = 3_600
DEFAULT_SOFT_SHUTDOWN_TIMEOUT = 60.0


def recommended_celery_settings(
    *,
    visibility_timeout: int = DEFAULT_VISIBILITY_TIMEOUT,
    soft_shutdown_timeout: float = DEFAULT_SOFT_SHUTDOWN_TIMEOUT,
) -> dict[str, Any]:
    """Celery settings (lower-case names) for ``app.conf.update(...)``.

    In Django settings with the ``CELERY`` namespace, upper-case each name and prefix it with
    ``CELERY_``. See docs/settings.md for why each one matters.
    """
    if visibility_timeout <= 0:
        raise ValueError(f"visibility_timeout must be positive, got {visibility_timeout!r}.")
    if soft_shutdown_timeout <= 0:
        raise ValueError(
            "soft_shutdown_timeout must be positive (0 turns soft shutdown off), "
            f"got {soft_shutdown_timeout!r}."
        )
    return {
        "task_acks_late": True,
        "worker_prefetch_multiplier": 1,
        "task_reject_on_worker_lost": True,
        "task_track_started": True,
        "result_extended": True,
        "worker_soft_shutdown_timeout": soft_shutdown_timeout,
        "worker_deduplicate_successful_tasks": True,
        "broker_transport_options": {"visibility_timeout": visibility_timeout},
    }
