"""Lifting a task's recovery cap: an operator who fixed what killed the task lets a sweep recover it once
more.

A task marked terminal at its cap keeps its message in the ledger for as long as its fence lives
(``ATTEMPTS_WINDOW_SECONDS``; ``CLAIM``, scripts/claims.py). Lifting the cap opens the fence for one recovery
more than it counts and puts the message back where the sweeps look (``LIFT``); the next sweep judges it
as any orphan, with the lifted cap (``rules.cap_of``), and sends it again once. Should it be lost
again, it is marked terminal at the new count, and may be lifted again.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from celery import Celery
from django.apps import apps
from django.db import transaction

from celery_orphans import logs
from celery_orphans.choices import AuditAction, Trigger
from celery_orphans.ledger import Ledger
from celery_orphans.recovery import audit, broker, rows

logger = logs.get(__name__)


@dataclass(frozen=True)
class Lifted:
    """What became of one task's lift: done or not, and a sentence saying so."""

    task_id: str
    lifted: bool
    message: str
    task_name: str = ""
    worker: str = ""


class _Refused(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def lift(
    app: Celery, ledger: Ledger, task_ids: Collection[str], *, trigger: Trigger, user: str
) -> list[Lifted]:
    """Lift the cap of each task, each in a transaction of its own with its audit row; one ``Lifted`` each.

    The workers are told first to forget the revoke their terminal mark broadcast, so the copy the next
    sweep sends is not dropped as revoked; a task whose lift is refused keeps its terminal fence, which
    drops every copy all the same.
    """
    broker.unrevoke(app, sorted(task_ids))
    return [_lift_one(ledger, task_id, trigger, user) for task_id in sorted(task_ids)]


def _lift_one(ledger: Ledger, task_id: str, trigger: Trigger, user: str) -> Lifted:
    name, worker = _capped_at(task_id)
    who = f"{name}[{task_id}]" if name else task_id
    try:
        with transaction.atomic():
            detail = "its recovery cap lifted by an operator: the next sweep sends it again, once"
            rows.reopen(task_id, detail)
            found = ledger.lift(task_id)
            if found.done == 0:
                raise _Refused(f"{who} is not marked terminal at its recovery cap (or its fence expired)")
            if found.done < 0:
                raise _Refused(
                    f"{who} was marked terminal, but its message is not kept: only a task marked terminal "
                    "at its recovery cap (limit_reached) can be recovered again"
                )
            detail = (
                f"recovery cap lifted after {found.attempts} recoveries: the next sweep sends it again, "
                f"once (recovery {found.attempts + 1})"
            )
            audit.record_lift(
                task_id,
                task_name=name,
                worker=worker,
                attempts=found.attempts,
                detail=detail,
                trigger=trigger,
                user=user,
            )
    except _Refused as exc:
        return Lifted(task_id, False, f"{exc.message}; nothing was changed.", name, worker)
    logger.warning(
        "recovery cap of %s lifted by %s: the next sweep sends it again, once", who, user or trigger
    )
    return Lifted(
        task_id,
        True,
        f"{who}: recovery cap lifted after {found.attempts} recoveries; the next sweep sends it again, once.",
        name,
        worker,
    )


def _capped_at(task_id: str) -> tuple[str, str]:
    """The task's name and the worker it was lost on, from its latest terminal mark (usually at the cap)."""
    found = (
        apps.get_model("celery_orphans", "OrphanEvent")
        .objects.filter(task_id=task_id, action=AuditAction.MARKED_TERMINAL)
        .order_by("-created_at", "-id")
        .values_list("task_name", "worker")
        .first()
    )
    return (str(found[0]), str(found[1])) if found else ("", "")
