"""Django signals sent after the reconcile acts, once its change is committed.

Every signal is sent with ``sender=OrphanEvent`` and these keyword arguments:

- ``task_id``, ``task_name``, ``worker``: the task and the node name that lost it;
- ``evidence``: what proved it orphaned (``no_reply_lease_lapsed``, ``found_at_boot``, ...);
- ``reason``: the decision's reason (``recoverable``, ``not_recoverable``, ``limit_reached``, ...);
- ``attempt``: the recovery attempt sent (``orphan_recovered``) or the count reached;
- ``trigger``: what ran the sweep (``beat``, ``command``, ``worker_boot``, ``worker``, ``admin``, ``api``).

``orphan_detected`` comes first for every orphan acted on, then one of the other two. A receiver that
raises is logged and does not stop the sweep or the other receivers.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from django.db import transaction
from django.dispatch import Signal

from celery_orphans.reconcile import Action

if TYPE_CHECKING:
    from celery_orphans.models import Trigger
    from celery_orphans.sweep import Outcome

logger = logging.getLogger(__name__)

orphan_detected = Signal()
orphan_recovered = Signal()
orphan_marked_terminal = Signal()

_FOLLOW_UP = {Action.RECOVER: orphan_recovered, Action.MARK_TERMINAL: orphan_marked_terminal}


def announce(outcome: Outcome, trigger: Trigger) -> None:
    """Send the signals for an action once the transaction it belongs to commits."""
    follow_up = _FOLLOW_UP.get(outcome.decision.action)
    if follow_up is None:
        return
    d = outcome.decision
    arguments: dict[str, Any] = {
        "task_id": d.task_id,
        "task_name": outcome.task_name,
        "worker": outcome.worker,
        "evidence": d.evidence.value,
        "reason": d.reason.value,
        "attempt": d.attempt,
        "trigger": str(trigger),
    }

    def send_both() -> None:
        _send(orphan_detected, arguments)
        _send(follow_up, arguments)

    transaction.on_commit(send_both)


def _send(signal: Signal, arguments: dict[str, Any]) -> None:
    from celery_orphans.models import OrphanEvent

    for receiver, result in signal.send_robust(sender=OrphanEvent, **arguments):
        if isinstance(result, Exception):
            logger.error(
                "celery-orphans: a receiver of a celery-orphans signal raised for task %s: %r (%s)",
                arguments["task_id"],
                result,
                getattr(receiver, "__qualname__", receiver),
            )
