import time

from celery import shared_task

from celery_orphans import recoverable


@recoverable
@shared_task(name="proj.slow")
def slow(seconds: float) -> float:
    """Found by ``app.autodiscover_tasks(["proj"])``."""
    time.sleep(seconds)
    return seconds
