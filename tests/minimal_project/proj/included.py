from celery import shared_task

from celery_orphans import recoverable


@recoverable
@shared_task(name="proj.included")
def included() -> str:
    """Found through the ``include`` setting."""
    return "included"
