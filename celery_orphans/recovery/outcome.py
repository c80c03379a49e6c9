"""What became of one decision: the task, its worker, whether it was carried out, and why not."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import redis
from django.db import DatabaseError

from celery_orphans.decision import Action, Decision, Reason
from celery_orphans.recovery.broker import UnsafeMessage


@dataclass(frozen=True)
class Outcome:
    """One decision, with what a person needs to read it: the task, its worker, when it started."""

    decision: Decision
    task_name: str
    worker: str
    done: bool = False  # the action was carried out (never in a dry run)
    error: str | None = None  # why carrying it out failed; the sweep stopped there
    started_at: datetime | None = None  # as the sweep found it, from the result row or the ledger entry
    boot: str | None = None  # the worker boot whose ledger entry holds the task, if one does

    def as_json(self) -> dict[str, Any]:
        """The one JSON shape of an outcome, in the command's ``--json`` and the HTTP API alike."""
        d = self.decision
        return {
            "task_id": d.task_id,
            "task_name": self.task_name,
            "worker": self.worker,
            "action": d.action.value,
            "reason": d.reason.value,
            "evidence": d.evidence.value,
            "detail": d.detail,
            "attempt": d.attempt,
            "done": self.done,
            "error": self.error,
        }


def describe(outcome: Outcome) -> str:
    """One log line's worth: what was done to which task, from which worker, and why."""
    d = outcome.decision
    if d.reason is Reason.ALREADY_SENT:
        return (
            f"finished recording recovery {d.attempt} of {outcome.task_name}[{d.task_id}] from worker "
            f"{outcome.worker or '?'}: {d.reason.value}"
        )
    attempt = f", attempt {d.attempt}" if d.action is Action.RECOVER else ""
    return (
        f"{_PAST[d.action]} {outcome.task_name}[{d.task_id}] from worker {outcome.worker or '?'}: "
        f"{d.reason.value} ({d.evidence.value or 'no evidence needed'}{attempt})"
    )


_PAST = {
    Action.RECOVER: "recovered",
    Action.MARK_TERMINAL: "marked terminal",
    Action.FORGET: "forgot finished",
}


def said(exc: BaseException) -> str:
    """A fault as an answer gives it: which service, and the kind; a library's text stays in the log."""
    if isinstance(exc, UnsafeMessage):
        return str(exc)  # our own sentence
    service = "Redis" if isinstance(exc, redis.RedisError) else "the database"
    if not isinstance(exc, (redis.RedisError, DatabaseError)):
        service = "the broker"
    return f"{service} failed ({type(exc).__name__}; see the server's log)"
