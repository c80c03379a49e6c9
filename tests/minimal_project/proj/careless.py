from celery import shared_task

from celery_orphans import recoverable


@recoverable
@shared_task(name="proj.careless", acks_late=False)
def careless() -> None:
    """Imported only when PROJ_MORE_IMPORTS names this module: its acks_late=False is check E004."""
