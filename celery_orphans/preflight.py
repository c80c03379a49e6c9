"""A worker's preflight: celery-orphans' system checks, run as it starts, and what their errors stop.

Celery's Django fixup runs every system check when a worker imports its tasks, and discards what they
find: a worker whose settings the checks reject would start quietly, run its tasks unprotected while its
operator believes them protected, and fail (or act unlike its settings say) in every sweep. So the worker
runs celery-orphans' own checks again at ``worker_init``, before it takes its lease, forks its pool or
consumes: each warning is one log line, and any error is one line too and stops the worker, as an error
stops ``manage.py migrate``. ``SILENCED_SYSTEM_CHECKS`` silences a check here as everywhere.
"""

from __future__ import annotations

import logging
import os

from django.core.checks import CheckMessage, run_checks

from celery_orphans import logs
from celery_orphans.checks import TAG

logger = logs.get(__name__)
# sysexits.h's EX_CONFIG, which os.EX_CONFIG names where the platform has it.
EXIT_CONFIG = getattr(os, "EX_CONFIG", 78)


def check_worker(node: str) -> None:
    """Log each warning of the checks in one line; on an error, log each in one line and stop the worker
    (``SystemExit`` with ``EXIT_CONFIG``)."""
    messages = [m for m in run_checks(tags=[TAG]) if not m.is_silenced()]  # as manage.py check does
    errors = [m for m in messages if m.is_serious()]
    for message in messages:
        if message.level >= logging.WARNING and not message.is_serious():
            logger.warning("%s", one_line(message))
    if not errors:
        return
    for message in errors:
        logger.error("%s", one_line(message))
    logger.error(
        "worker %s will not start: %d configuration error%s above would leave its tasks "
        "unprotected or its sweeps unlike its settings. Fix %s (python manage.py check --tag %s lists "
        "%s), or silence a check you accept with SILENCED_SYSTEM_CHECKS",
        node,
        len(errors),
        "" if len(errors) == 1 else "s",
        "it" if len(errors) == 1 else "them",
        TAG,
        "it" if len(errors) == 1 else "them",
    )
    raise SystemExit(EXIT_CONFIG)


def one_line(message: CheckMessage) -> str:
    """``celery_orphans.E011: <message> HINT: <hint>``, on one line, as a log line should be."""
    text = f"{message.id}: {message.msg}"
    if message.obj is not None:
        text = f"{message.id}: {message.obj}: {message.msg}"
    if message.hint:
        text += f" HINT: {message.hint}"
    return " ".join(text.split())
