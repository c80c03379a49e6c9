"""What a sweep is asked to do (``Options``) and what it did (``Outcome`` per task, ``Report`` in all)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from celery_orphans.choices import Trigger
from celery_orphans.exceptions import CeleryOrphansError
from celery_orphans.reconcile import Action, Decision, Reason


class SweepFailed(CeleryOrphansError):
    """The sweep stopped part way; what it finished is kept and the rest is found again next time."""

    def __init__(self, message: str, report: Report) -> None:
        super().__init__(message)
        self.report = report


@dataclass(frozen=True)
class BootScope:
    """A worker judging its own name's tasks at boot: what it holds now is exact, no broadcast needed."""

    node: str
    boot: str
    booted_at: datetime
    held: Callable[[], frozenset[str]]


@dataclass(frozen=True)
class Options:
    trigger: Trigger
    dry_run: bool = False
    grace_seconds: float | None = None
    max_attempts: int | None = None
    user: str = ""
    boot: BootScope | None = None
    shadow: bool | None = None  # None: CELERY_ORPHANS_SHADOW_MODE
    task_ids: frozenset[str] | None = None  # judge only these tasks (an operator's selection)
    acts: frozenset[Action] | None = None  # carry out only these actions; report the others
    mark_terminal: bool = False  # an operator closes the selected orphans instead of recovering them


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


@dataclass
class Report:
    outcomes: list[Outcome] = field(default_factory=list)
    duration: float = 0.0
    dry_run: bool = False
    shadow: bool = False

    def count(self, action: Action, *, done_only: bool = False) -> int:
        return sum(1 for o in self.outcomes if o.decision.action is action and (o.done or not done_only))

    def summary(self) -> str:
        acted = [o for o in self.outcomes if o.done or self.dry_run]
        # A recovery sent by an earlier sweep is not counted again when this one finishes recording it.
        completed = sum(1 for o in acted if o.decision.reason is Reason.ALREADY_SENT)
        counts = Counter(o.decision.action for o in acted)
        alive = self.count(Action.LEAVE)
        verb = "would have " if self.dry_run or self.shadow else ""
        finished = f", {verb}finished recording {completed} sent earlier" if completed else ""
        return (
            f"{verb}recovered {counts[Action.RECOVER] - completed} orphaned tasks, {verb}marked "
            f"{counts[Action.MARK_TERMINAL]} terminal, {verb}forgotten {counts[Action.FORGET]} finished, "
            f"{alive} alive or in grace, {self.count(Action.REPORT)} unreadable{finished}"
            f" ({self.duration:.2f}s)"
        )
