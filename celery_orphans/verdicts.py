"""How a person reads a running task's decision: its verdict (alive, in grace, will recover, ...).

The admin's in-flight page and the API's status counts use one vocabulary, ``Verdict``.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.utils import timezone

from celery_orphans.decision import Action, Decision, Evidence, Reason
from celery_orphans.recovery.outcome import Outcome


class Verdict(str, enum.Enum):
    ALIVE = "alive"
    IN_GRACE = "in_grace"
    HANDED_BACK = "handed_back"
    WILL_RECOVER = "will_recover"
    WILL_MARK_TERMINAL = "will_mark_terminal"
    NOT_RECOVERABLE = "not_recoverable"
    DEFERRED = "deferred"
    FINISHED = "finished"
    # Reported, not judged: a record that cannot be trusted or read, a task this app does not know, a
    # task no record names a worker for. Each is named apart: they call for different fixes.
    UNREADABLE = "unreadable"
    UNKNOWN_TASK = "unknown_task"
    NO_WORKER = "no_worker"


def verdict(d: Decision) -> tuple[Verdict, str]:
    """The verdict on one running task, and how a person reads it."""
    if d.action is Action.LEAVE:
        if d.reason is Reason.IN_GRACE:
            return Verdict.IN_GRACE, "in grace"
        if d.reason is Reason.DEFERRED:
            return Verdict.DEFERRED, f"orphan (deferred: {d.detail})"
        if d.reason is Reason.HANDED_BACK:
            return Verdict.HANDED_BACK, "handed back to the broker"
        if d.reason is Reason.ALREADY_FINISHED:
            return Verdict.FINISHED, f"finished ({d.detail})"
        return Verdict.ALIVE, "alive"
    if d.action is Action.RECOVER:
        if d.reason is Reason.ALREADY_SENT:
            return Verdict.WILL_RECOVER, f"orphan (sent again as recovery {d.attempt}; not yet recorded)"
        return Verdict.WILL_RECOVER, "orphan (will be recovered)"
    if d.action is Action.MARK_TERMINAL:
        if d.reason is Reason.NOT_RECOVERABLE:
            return Verdict.NOT_RECOVERABLE, "not recoverable"
        return Verdict.WILL_MARK_TERMINAL, f"orphan (will be marked terminal: {d.detail})"
    if d.action is Action.FORGET:
        return Verdict.FINISHED, f"finished ({d.detail})"
    if d.reason is Reason.UNKNOWN_TASK:
        return Verdict.UNKNOWN_TASK, f"unknown task: {d.detail}"
    if d.reason is Reason.NO_WORKER:
        return Verdict.NO_WORKER, f"no worker: {d.detail}"
    return Verdict.UNREADABLE, f"unreadable: {d.detail}"


# What each piece of evidence says, for the admin's tooltips. lease_lapsed and process_exited are the
# same kind of death, told apart by who noticed it: a worker on the dead one's machine, or Redis's expiry.
_DEAD = "dead: "
EVIDENCE_MEANING = {
    Evidence.BOOT_ALIVE: "alive: the worker boot that runs it holds its lease",
    Evidence.WORKER_HOLDS_TASK: "alive: its worker answered that it holds the task",
    Evidence.NO_REPLY_LEASE_FRESH: "taken as alive: its node did not answer, but a lease under its name is "
    "fresh",
    Evidence.LEASE_LAPSED: _DEAD + "the lease of the worker boot that ran it lapsed; Redis's expiry "
    "noticed, as no worker on its machine saw its process exit (another host, a lost node, or the worker "
    "gave the task up)",
    Evidence.PROCESS_EXITED: _DEAD + "a worker on the same machine saw the main process of the boot that "
    "ran it exit, before its lease could lapse (the same death as lease_lapsed, seen sooner)",
    Evidence.PRESENCE_LOST: _DEAD + "Redis dropped the presence connection of the main process of the "
    "boot that ran it, and the boot did not renew its lease in the heartbeat and a half that followed (the "
    "same death as lease_lapsed, seen sooner, from another host)",
    Evidence.WORKER_ANSWERED_WITHOUT_TASK: _DEAD + "a worker restarted under its node name answered "
    "without the task",
    Evidence.NO_REPLY_NO_LEASE: _DEAD + "its node did not answer and holds no fresh lease",
    Evidence.FOUND_AT_BOOT: _DEAD + "the next boot under its node name found it among that name's tasks",
    Evidence.POOL_CHILD_LOST: "its pool process died while the worker lived (often the OOM killer)",
    Evidence.BROKER_REDELIVERED: "the broker delivered it again while the execution that lost it was on "
    "record",
    Evidence.CAP_LIFTED: "marked terminal at its recovery cap, which an operator lifted: no execution runs "
    "it, and the next sweep sends it again once",
}


def meaning(evidence: str) -> str:
    """What a piece of evidence says, in a sentence; empty for none or one this version does not know."""
    try:
        return EVIDENCE_MEANING.get(Evidence(evidence), "")
    except ValueError:
        return ""


@dataclass(frozen=True)
class InFlight:
    """One running task as the sweep would judge it now."""

    outcome: Outcome
    verdict: Verdict
    label: str
    heartbeat_age: float | None  # seconds since its worker boot last renewed its lease; None: none on record

    @property
    def evidence_meaning(self) -> str:
        return meaning(self.outcome.decision.evidence.value)

    @property
    def heartbeat_age_text(self) -> str:
        return "no heartbeat on record" if self.heartbeat_age is None else _ago(self.heartbeat_age)

    @property
    def started_at(self) -> datetime | None:
        return self.outcome.started_at

    @property
    def started_text(self) -> str:
        if self.started_at is None:
            return "—"
        return _ago((timezone.now() - self.started_at).total_seconds())


def _ago(seconds: float) -> str:
    whole = max(0, round(seconds))
    if whole < 120:
        return f"{whole} s ago"
    return f"{whole // 60} min ago" if whole < 7200 else f"{whole // 3600} h ago"


def counted(decisions: Iterable[list[Any]]) -> tuple[dict[str, int], dict[str, int]]:
    """Tasks by verdict, and the orphans among them, from ``[action, reason, evidence, count]`` rows
    (as the last sweep recorded them)."""
    running: Counter[str] = Counter()
    orphans: Counter[str] = Counter()
    for action, reason, evidence, count in decisions:
        d = Decision("", Action(action), Reason(reason), Evidence(evidence))
        shown = verdict(d)[0].value
        running[shown] += count
        if d.orphaned:
            orphans[shown] += count
    every = [v.value for v in Verdict]
    return (
        {"total": sum(running.values()), **{v: running[v] for v in every}},
        {"total": sum(orphans.values()), **{v: orphans[v] for v in every}},
    )
