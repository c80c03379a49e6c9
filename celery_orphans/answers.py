"""What the operators' service answers, whichever door asked: one ``Result`` per task, with one JSON
shape (the command's ``--json``, the HTTP API) and one ``Status`` vocabulary, in an ``Answer``."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from celery_orphans.decision import Action, Reason
from celery_orphans.recovery.outcome import Outcome
from celery_orphans.sweep.values import Report


class Status(str, enum.Enum):
    """What became of one task, in every door's answer."""

    RECOVERED = "recovered"
    MARKED_TERMINAL = "marked_terminal"
    FORGOTTEN = "forgotten"
    WOULD_RECOVER = "would_recover"  # a dry run, or shadow mode
    WOULD_MARK_TERMINAL = "would_mark_terminal"
    WOULD_FORGET = "would_forget"
    LEFT = "left"  # a sweep left it alone (alive, in grace, unreadable, ...): the reason says why
    REFUSED = "refused"  # an operator chose it and it may not be acted on: the reason says why
    CHANGED = "changed"  # it changed while it was checked; look again
    NOT_FOUND = "not_found"  # an operator chose an id no running task has
    FAILED = "failed"  # carrying the action out failed; the sweep stopped there
    NOT_ATTEMPTED = "not_attempted"  # after a failure


_DONE = {Action.RECOVER: Status.RECOVERED, Action.MARK_TERMINAL: Status.MARKED_TERMINAL}
_DONE[Action.FORGET] = Status.FORGOTTEN
_WOULD = {
    Action.RECOVER: Status.WOULD_RECOVER,
    Action.MARK_TERMINAL: Status.WOULD_MARK_TERMINAL,
    Action.FORGET: Status.WOULD_FORGET,
}
_FAILED = frozenset({Status.FAILED, Status.NOT_ATTEMPTED})


_REFUSED = frozenset({Status.REFUSED, Status.CHANGED, Status.NOT_FOUND})


@dataclass(frozen=True)
class Result:
    """One task in an answer: what became of it, and the decision about it (none for an unknown id)."""

    task_id: str
    status: Status
    message: str  # a sentence a person can read
    outcome: Outcome | None = None

    @property
    def failed(self) -> bool:
        return self.status in _FAILED

    @property
    def refused(self) -> bool:
        return self.status in _REFUSED

    def as_json(self) -> dict[str, Any]:
        """The one JSON shape of a task's result: the command's ``--json`` and the HTTP API alike."""
        decided = self.outcome.as_json() if self.outcome else dict.fromkeys(_OUTCOME_FIELDS)
        return {**decided, "task_id": self.task_id, "status": self.status.value, "message": self.message}


_OUTCOME_FIELDS = (
    "task_name",
    "worker",
    "action",
    "reason",
    "evidence",
    "detail",
    "attempt",
    "done",
    "error",
)


@dataclass(frozen=True)
class Answer:
    """What a sweep or an operator's action did: a summary line and one result per task."""

    summary: str
    shadow: bool
    dry_run: bool
    results: list[Result]
    error: str | None = None  # why the sweep stopped part way

    def shown(self, *, every: bool = False) -> list[Result]:
        """The results worth showing: all of them, or those not simply left alone."""
        return [r for r in self.results if every or r.status is not Status.LEFT]

    def as_json(self) -> dict[str, Any]:
        return {
            "summary": self.summary,
            "shadow": self.shadow,
            "dry_run": self.dry_run,
            "results": [r.as_json() for r in self.shown()],
            "error": self.error,
        }


def answer(report: Report, wanted: Action | None, error: str | None) -> Answer:
    results, stopped = [], False
    for o in report.outcomes:
        results.append(result_of(o, wanted, report, stopped))
        stopped = stopped or o.error is not None
    return Answer(report.summary(), report.shadow, report.dry_run, results, error)


_WOULD_TEXT = {
    Action.RECOVER: "would be recovered",
    Action.MARK_TERMINAL: "would be marked terminal",
    Action.FORGET: "would be forgotten",
}


def result_of(o: Outcome, wanted: Action | None, report: Report, stopped: bool) -> Result:
    """What became of one task: of a whole sweep (``wanted`` is ``None``) or of an operator's choice."""
    d = o.decision
    ref = f"{o.task_name or '?'}[{d.task_id}]"
    verb = "mark terminal" if wanted is Action.MARK_TERMINAL else "recover"

    def result(status: Status, message: str) -> Result:
        return Result(d.task_id, status, message, o)

    acted_on = d.action is wanted if wanted is not None else d.action in _DONE
    if o.error is not None:
        return result(Status.FAILED, f"Could not {verb} {ref}: {o.error}. Nothing after it was tried.")
    if acted_on and report.dry_run:
        return result(_WOULD[d.action], f"Dry run: {ref} {_WOULD_TEXT[d.action]}.")
    if acted_on and o.done and report.shadow:
        return result(_WOULD[d.action], f"Shadow mode: only recorded that {ref} {_WOULD_TEXT[d.action]}.")
    if acted_on and o.done:
        if d.action is Action.RECOVER:
            return result(Status.RECOVERED, f"Recovered {ref} (attempt {d.attempt}): sent again.")
        if d.action is Action.MARK_TERMINAL:
            return result(Status.MARKED_TERMINAL, f"Marked {ref} terminal: its result is now FAILURE.")
        return result(Status.FORGOTTEN, f"Forgot the ledger entry of {ref}: it had finished.")
    if acted_on:
        if stopped:
            return result(Status.NOT_ATTEMPTED, f"Did not {verb} {ref}: an earlier task failed.")
        return result(Status.CHANGED, f"Left {ref}: it changed while being checked; look again.")
    if wanted is None:
        return result(Status.LEFT, f"Left {ref}: {d.reason.value.replace('_', ' ')}.")
    if d.reason is Reason.ALIVE:
        why = f"worker {o.worker} is alive and still has it ({d.evidence.value.replace('_', ' ')})"
    elif d.reason is Reason.NOT_RECOVERABLE:
        why = f"{o.task_name} is not marked @recoverable, so it is never sent again"
    elif d.reason is Reason.IN_GRACE:
        why = "it started too recently to judge"
    else:
        why = d.detail or d.reason.value.replace("_", " ")
    left = "; it was left as it is (close it with the admin's “Mark terminal”)"
    left = left if d.action is Action.MARK_TERMINAL else ""
    return result(Status.REFUSED, f"Refused to {verb} {ref}: {why}{left}.")
