"""The sweep: gather what is running, let ``rules.decide`` judge it, carry the decisions out.

``run(Options(...))`` runs one sweep and returns its ``Report``; the modules here are its parts:
``candidates`` and ``rows`` (what the records say is running), ``liveness`` (the workers' answers and
leases), ``actions`` (carrying out a decision: claims, result rows, the broker, the audit log), ``lock``
(one sweep at a time) and ``boot`` (a booting worker's sweep of its own name).
"""

from celery_orphans.recovery.outcome import Outcome
from celery_orphans.sweep.runner import last_sweep, run
from celery_orphans.sweep.values import BootScope, Options, Report, SweepFailed

__all__ = ["BootScope", "Options", "Outcome", "Report", "SweepFailed", "last_sweep", "run"]
