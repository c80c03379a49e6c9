"""The names of what the audit log records: what was done, and what set it off.

Apart from ``models.py`` so that the worker and the sweep can name them before Django's apps are ready.
"""

from __future__ import annotations

from django.db import models


class AuditAction(models.TextChoices):
    """What an audit row records was done (or, in shadow mode, would have been)."""

    RECOVERED = "recovered", "Recovered"
    MARKED_TERMINAL = "marked_terminal", "Marked terminal"
    FORGOTTEN = "forgotten", "Forgotten (already finished)"
    WOULD_RECOVER = "would_recover", "Would recover (shadow mode)"
    WOULD_MARK_TERMINAL = "would_mark_terminal", "Would mark terminal (shadow mode)"
    WOULD_FORGET = "would_forget", "Would forget (shadow mode)"
    DUPLICATE_DROPPED = "duplicate_dropped", "Duplicate dropped (the task runs elsewhere)"
    REPORTED = "reported", "Reported (a record that cannot be trusted; nothing sent)"
    FAILED = "failed", "Failed (an action could not be carried out)"
    REFUSED = "refused", "Refused (a request that did nothing)"
    NOTHING_TO_DO = "nothing_to_do", "Swept with nothing to do"
    CAP_LIFTED = "cap_lifted", "Recovery cap lifted (the next sweep recovers it once more)"


class Trigger(models.TextChoices):
    BEAT = "beat", "Beat schedule"
    COMMAND = "command", "Management command"
    WORKER_BOOT = "worker_boot", "Worker boot"
    WATCH = "watch", "Worker watch (a lease lapsed or a process exited)"
    WORKER = "worker", "Worker (pool process lost)"
    ADMIN = "admin", "Admin action"
    API = "api", "HTTP endpoint"
