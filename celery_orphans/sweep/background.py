"""A sweep a worker runs itself, in a thread of its own: at boot (``boot``), or when its watch saw a
boot gone (``watch``). One loop for both: while another sweep holds the lock it tries again, then gives
way; whatever goes wrong is logged, so the thread never dies without a word."""

from __future__ import annotations

import time
from collections.abc import Callable

from celery import Celery
from django.core.exceptions import ImproperlyConfigured
from django.db import close_old_connections

from celery_orphans import logs
from celery_orphans.exceptions import CeleryOrphansError, SweepLocked
from celery_orphans.sweep.runner import run
from celery_orphans.sweep.values import Options, Report

logger = logs.get(__name__)


# While another sweep holds the lock, try again this often (a sweep holds it for tens of milliseconds),
# for at most this long; then give way: that sweep, or the next of Beat's, judges what this one would.
LOCK_RETRY_SECONDS = 0.05
GIVE_WAY_AFTER_SECONDS = 10.0


def sweep_giving_way(name: str, options: Callable[[], Options | None], app: Celery | None) -> Report | None:
    """Run the sweep ``options()`` describes (``None``: none is needed), trying again while another holds
    the lock (``LOCK_RETRY_SECONDS``, ``GIVE_WAY_AFTER_SECONDS``); its report, or ``None`` if it did not
    run. ``name`` says in the log which sweep it was. Closes the thread's database connections."""
    try:
        asked = options()
        if asked is None:
            return None
        give_way_at = time.monotonic() + GIVE_WAY_AFTER_SECONDS
        while True:
            try:
                return run(asked, app)
            except SweepLocked:
                if time.monotonic() >= give_way_at:
                    break
                time.sleep(LOCK_RETRY_SECONDS)
        logger.info("%s gave way to other sweeps", name)
    except (CeleryOrphansError, ImproperlyConfigured) as exc:
        logger.error("%s failed: %s", name, exc)
    except Exception:  # a thread's exception is printed, not logged: log it, with its traceback
        logger.exception("%s failed", name)
    finally:
        close_old_connections()
    return None
