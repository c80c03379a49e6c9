"""What a sweep is asked to do (``Options``) and what it did (``Report``, an ``Outcome`` per task)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime

from celery_orphans.choices import Trigger
from celery_orphans.decision import Action, Reason
from celery_orphans.exceptions import CeleryOrphansError
from celery_orphans.recovery.outcome import Outcome


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
    grace_seconds: float | None = None  # asked for: spares every younger task, its boot gone or not
    max_attempts: int | None = None
    user: str = ""
    boot: BootScope | None = None
    shadow: bool | None = None  # None: CELERY_ORPHANS_SHADOW_MODE
    task_ids: frozenset[str] | None = None  # judge only these tasks (an operator's selection)
    acts: frozenset[Action] | None = None  # carry out only these actions; report the others
    mark_terminal: bool = False  # an operator closes the selected orphans instead of recovering them
    ask_workers: bool = True  # False: no broadcast; a task only a result row knows of is judged by leases


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
        reported = self.reported()
        # Reported and not judged, each named apart: the ones besides the unreadable only when there are any.
        others = "".join(
            f", {reported[reason]} {label}" for reason, label in _REPORTED_APART if reported[reason]
        )
        return (
            f"{verb}recovered {counts[Action.RECOVER] - completed} orphaned tasks, {verb}marked "
            f"{counts[Action.MARK_TERMINAL]} terminal, {verb}forgotten {counts[Action.FORGET]} finished, "
            f"{alive} alive or in grace, {reported[Reason.UNREADABLE]} unreadable{others}{finished}"
            f" ({self.duration:.2f}s)"
        )

    def reported(self) -> Counter[Reason]:
        """The tasks reported without being judged, by reason (unreadable, unknown task, no worker)."""
        return Counter(o.decision.reason for o in self.outcomes if o.decision.action is Action.REPORT)


# How the summary names the tasks reported for a reason other than an unreadable record.
_REPORTED_APART = (
    (Reason.UNKNOWN_TASK, "of a task not registered here"),
    (Reason.NO_WORKER, "without a worker"),
)
