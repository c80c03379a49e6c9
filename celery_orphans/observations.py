"""What the decision is a pure function of: what the records say about a task that may be running
(``Candidate``), and what one node name told the sweep (``WorkerView``)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime


@dataclass(frozen=True)
class Candidate:
    """What the records say about one task that may be running."""

    task_id: str
    task_name: str | None
    worker: str | None
    boot: str | None  # the owner's boot id, known only from a ledger entry
    started_at: datetime | None
    row_status: str | None  # None when there is no TaskResult row
    has_entry: bool
    attempts: int = 0  # recoveries already made
    task_known: bool = True
    recoverable: bool = False
    group: str | None = None
    max_attempts: int | None = None  # the task's own cap, if it set one
    lifted: int = 0  # the count an operator lifted its cap to, once it was reached (0: never lifted)
    content_type: str | None = None  # of the ledger entry's message
    problem: str | None = None  # why a record could not be read
    sent_again: bool = False  # its entry's delivery was already sent again, as recovery ``attempts``
    handed_back_at: datetime | None = None  # when its worker gave the message back to the broker

    @property
    def lift_unused(self) -> bool:
        """An operator lifted its cap and no recovery has used the lift yet."""
        return self.lifted > self.attempts


@dataclass(frozen=True)
class WorkerView:
    """What one node name told us: whether it answered the broadcast, which ids it holds, its leases."""

    replied: bool
    held: frozenset[str] = frozenset()
    fresh_boots: frozenset[str] = frozenset()
    gone_boots: frozenset[str] = frozenset()  # boots whose record says they are gone, not just unknown
    exited_boots: frozenset[str] = frozenset()  # of those, the ones whose process was seen to exit
    presence_lost_boots: frozenset[str] = frozenset()  # of those, the ones whose presence Redis dropped
    at_boot: bool = False  # the view is the booting worker's own: it knows exactly what it holds
    asked: frozenset[str] | None = None  # the ids it was asked about (None: every id); a reply says no more

    def answers_for(self, task_id: str) -> bool:
        """Whether the node replied, and was asked whether it holds ``task_id``."""
        return self.replied and (self.asked is None or task_id in self.asked)
