from celery import shared_task

from celery_orphans import recoverable


@recoverable
@shared_task(name="proj.imported")
def imported() -> str:
    """Found through the ``imports`` setting."""
    return "imported"
