"""Kept for projects that name the Request class by this path; the hook lives in ``worker/request.py``."""

from celery_orphans.worker.request import RecoverableRequestMixin, recoverable_request_class

__all__ = ["RecoverableRequestMixin", "recoverable_request_class"]
