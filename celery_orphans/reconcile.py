"""The decision: observations in, one decision per candidate out. No I/O happens here.

A candidate is a task that some record says is running: a STARTED ``TaskResult`` row, a ledger entry, or
both. The sweep gathers what it could observe about each one (its row, its entry, its worker's answer to
one broadcast, the worker's lease, the recovery count) and this module decides what to do.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta

READY_STATES = frozenset({"SUCCESS", "FAILURE", "REVOKED", "IGNORED"})
# How far ahead of the sweep's clock a recorded start may be and still count as "just started": hosts
# synchronised by NTP differ by far less. Beyond it the start time itself cannot be believed.
CLOCK_TOLERANCE = timedelta(seconds=5)
# How long a message its worker handed back to the broker (a shutdown, a requeue) is left to the broker to
# deliver again before the ledger's copy counts as the only one: a hand-back that never reached the broker
# is recovered after this long.
HAND_BACK_GRACE = timedelta(minutes=5)


class Action(str, enum.Enum):
    RECOVER = "recover"
    MARK_TERMINAL = "mark_terminal"
    FORGET = "forget"  # drop a ledger entry left behind by a task that finished
    LEAVE = "leave"
    REPORT = "report"  # cannot be judged; untouched


class Evidence(str, enum.Enum):
    """What proved the owner alive or gone."""

    WORKER_HOLDS_TASK = "worker_holds_task"
    BOOT_ALIVE = "boot_alive"  # the worker boot its ledger entry names still holds its lease
    LEASE_LAPSED = "lease_lapsed"  # that boot's lease is gone: the boot gave up what it ran (fence.py)
    PROCESS_EXITED = "process_exited"  # a process on its machine saw that boot's process exit
    WORKER_ANSWERED_WITHOUT_TASK = "worker_answered_without_task"
    NO_REPLY_LEASE_FRESH = "no_reply_lease_fresh"
    NO_REPLY_NO_LEASE = "no_reply_no_lease"
    FOUND_AT_BOOT = "found_at_boot"  # the worker's next boot found it among its own name's tasks
    POOL_CHILD_LOST = "pool_child_lost"  # its pool process died (often the OOM killer); the worker lived
    BROKER_REDELIVERED = "broker_redelivered"  # the broker delivered it again over its unreleased entry
    NONE = ""


class Reason(str, enum.Enum):
    RECOVERABLE = "recoverable"
    NOT_RECOVERABLE = "not_recoverable"
    GROUP_DISABLED = "group_disabled"
    NO_LEDGER_ENTRY = "no_ledger_entry"
    LIMIT_REACHED = "limit_reached"
    TOO_OLD = "too_old"
    UNSAFE_MESSAGE = "unsafe_message"
    DEFERRED = "deferred"  # over the per-sweep recovery limit; next sweep
    BY_OPERATOR = "by_operator"  # a person chose to close it rather than recover it
    ALREADY_FINISHED = "already_finished"
    ALREADY_SENT = "already_sent"  # an earlier sweep sent it again but could not finish its bookkeeping
    HANDED_BACK = "handed_back"  # its worker gave the message back to the broker, which delivers it again
    ALIVE = "alive"
    IN_GRACE = "in_grace"
    NO_WORKER = "no_worker"
    UNKNOWN_TASK = "unknown_task"
    UNREADABLE = "unreadable"


ORPHAN_EVIDENCE = frozenset(
    {
        Evidence.WORKER_ANSWERED_WITHOUT_TASK,
        Evidence.LEASE_LAPSED,
        Evidence.PROCESS_EXITED,
        Evidence.NO_REPLY_NO_LEASE,
        Evidence.FOUND_AT_BOOT,
        Evidence.POOL_CHILD_LOST,
        Evidence.BROKER_REDELIVERED,
    }
)


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
    content_type: str | None = None  # of the ledger entry's message
    problem: str | None = None  # why a record could not be read
    sent_again: bool = False  # its entry's delivery was already sent again, as recovery ``attempts``
    handed_back_at: datetime | None = None  # when its worker gave the message back to the broker


@dataclass(frozen=True)
class WorkerView:
    """What one node name told us: whether it answered the broadcast, which ids it holds, its leases."""

    replied: bool
    held: frozenset[str] = frozenset()
    fresh_boots: frozenset[str] = frozenset()
    gone_boots: frozenset[str] = frozenset()  # boots whose record says they are gone, not just unknown
    exited_boots: frozenset[str] = frozenset()  # of those, the ones whose process was seen to exit
    at_boot: bool = False  # the view is the booting worker's own: it knows exactly what it holds
    asked: frozenset[str] | None = None  # the ids it was asked about (None: every id); a reply says no more

    def answers_for(self, task_id: str) -> bool:
        """Whether the node replied, and was asked whether it holds ``task_id``."""
        return self.replied and (self.asked is None or task_id in self.asked)


# Content types whose bodies are data, never code. A pickled message is never sent again.
SAFE_CONTENT_TYPES = frozenset(
    {"application/json", "application/x-msgpack", "application/x-yaml", "application/data"}
)


@dataclass(frozen=True)
class Policy:
    now: datetime
    grace: timedelta
    max_attempts: int
    groups: Mapping[str, bool]
    max_age: timedelta | None = None


@dataclass(frozen=True)
class Decision:
    task_id: str
    action: Action
    reason: Reason
    evidence: Evidence = Evidence.NONE
    detail: str = ""
    attempt: int | None = None  # the attempt a recovery sends; the count reached otherwise

    @property
    def orphaned(self) -> bool:
        return self.evidence in ORPHAN_EVIDENCE


def decide(candidate: Candidate, worker: WorkerView | None, policy: Policy) -> Decision:
    """Decide what to do with one candidate, given what its worker said and the rules in force."""
    c = candidate
    if c.problem:
        return Decision(c.task_id, Action.REPORT, Reason.UNREADABLE, detail=c.problem)
    if not c.worker:
        return Decision(c.task_id, Action.REPORT, Reason.NO_WORKER, detail="no worker is recorded")
    if not c.task_name or not c.task_known:
        return Decision(
            c.task_id,
            Action.REPORT,
            Reason.UNKNOWN_TASK,
            detail=f"task {c.task_name or '(no name)'!r} is not registered in this Celery app",
        )
    if c.started_at is None:
        return Decision(c.task_id, Action.REPORT, Reason.UNREADABLE, detail="no start time is recorded")
    if c.started_at > policy.now + CLOCK_TOLERANCE:
        # A clock that is ahead or a forged record: no age can be judged from it, so nothing is done
        # until a person looks or the start time is reached.
        return Decision(
            c.task_id,
            Action.REPORT,
            Reason.UNREADABLE,
            detail=f"its start time {c.started_at.isoformat()} is in the future: a clock is ahead or the "
            "record is wrong",
        )
    if c.sent_again:
        # Whatever its worker says now: the message is out and the fence drops the copy the entry
        # records. Sending it again would be a second publish and a second counted attempt.
        return Decision(
            c.task_id,
            Action.RECOVER,
            Reason.ALREADY_SENT,
            detail=f"recovery {c.attempts} was sent by an earlier sweep that could not finish recording it",
            attempt=c.attempts,
        )
    w = worker or WorkerView(replied=False)
    # The grace keeps a task's records from being judged while they are being written. A task whose
    # ledger entry names a boot known gone needs none: that boot's lease was written before the entry.
    boot_gone = c.boot is not None and not w.at_boot and c.boot in w.gone_boots
    if c.started_at > policy.now - policy.grace and not boot_gone:
        return Decision(c.task_id, Action.LEAVE, Reason.IN_GRACE)
    if c.handed_back_at is not None and c.handed_back_at > policy.now - HAND_BACK_GRACE:
        return Decision(
            c.task_id,
            Action.LEAVE,
            Reason.HANDED_BACK,
            detail=f"its worker gave the message back to the broker at {c.handed_back_at.isoformat()}",
        )
    evidence = judge(c, w)
    if evidence not in ORPHAN_EVIDENCE:
        return Decision(c.task_id, Action.LEAVE, Reason.ALIVE, evidence)
    return _act_on_orphan(c, evidence, policy)


def judge(candidate: Candidate, worker: WorkerView) -> Evidence:
    """Alive or gone: from the lease of the boot that runs it, or from its worker's answer.

    A ledger entry names the worker boot that runs the task. While that boot holds its lease it is alive;
    once the lease is gone the boot has given up what it ran (a worker stops its executions before its
    lease can lapse: ``worker/fence.py``), so no question need be asked. A task known from its result row
    alone may be run by any live boot of its node name: that node's answer decides, and without one, its
    leases. A booting worker's own view is exact for the earlier boots of its name.
    """
    c, w = candidate, worker
    if w.at_boot:
        return Evidence.WORKER_HOLDS_TASK if c.task_id in w.held else Evidence.FOUND_AT_BOOT
    if c.boot is not None:
        if c.boot not in w.fresh_boots:
            return Evidence.PROCESS_EXITED if c.boot in w.exited_boots else Evidence.LEASE_LAPSED
        held = w.answers_for(c.task_id) and c.task_id in w.held
        return Evidence.WORKER_HOLDS_TASK if held else Evidence.BOOT_ALIVE
    if w.answers_for(c.task_id):
        return Evidence.WORKER_HOLDS_TASK if c.task_id in w.held else Evidence.WORKER_ANSWERED_WITHOUT_TASK
    return Evidence.NO_REPLY_LEASE_FRESH if w.fresh_boots else Evidence.NO_REPLY_NO_LEASE


def after_pool_loss(candidate: Candidate, policy: Policy) -> Decision:
    """The worker saw the pool process running this task die: recover it, within the same cap."""
    return _act_on_orphan(candidate, Evidence.POOL_CHILD_LOST, policy)


def after_redelivery(candidate: Candidate, policy: Policy, *, limit_reached: bool) -> Decision:
    """The broker delivered an orphan's message again and the ledger counted it, or found the cap reached.

    ``candidate.attempts`` is the count before this delivery. The broker has already sent the task
    again, so only the cap can stop it: a group switched off or an unsafe message governs what a
    sweep sends, not what the broker does.
    """
    c, cap, evidence = candidate, candidate.max_attempts or policy.max_attempts, Evidence.BROKER_REDELIVERED
    if limit_reached:
        detail = f"already recovered {c.attempts} of {cap} times"
        return Decision(c.task_id, Action.MARK_TERMINAL, Reason.LIMIT_REACHED, evidence, detail, c.attempts)
    detail = f"recovery {c.attempts + 1} of {cap}, delivered again by the broker"
    return Decision(c.task_id, Action.RECOVER, Reason.RECOVERABLE, evidence, detail, c.attempts + 1)


def _act_on_orphan(c: Candidate, evidence: Evidence, policy: Policy) -> Decision:
    def terminal(reason: Reason, detail: str) -> Decision:
        return Decision(c.task_id, Action.MARK_TERMINAL, reason, evidence, detail, c.attempts)

    if c.row_status in READY_STATES:
        return Decision(
            c.task_id,
            Action.FORGET,
            Reason.ALREADY_FINISHED,
            evidence,
            f"the task already ended {c.row_status}",
            c.attempts,
        )
    if not c.recoverable:
        return terminal(Reason.NOT_RECOVERABLE, f"{c.task_name} is not marked @recoverable")
    if c.group is not None and not policy.groups.get(c.group, True):
        return terminal(Reason.GROUP_DISABLED, f"recovery of group {c.group!r} is switched off")
    if not c.has_entry:
        return terminal(Reason.NO_LEDGER_ENTRY, "no ledger entry holds the message to send again")
    if c.content_type not in SAFE_CONTENT_TYPES:
        return terminal(Reason.UNSAFE_MESSAGE, f"a {c.content_type or 'untyped'} message is never sent again")
    if policy.max_age is not None and c.started_at is not None and c.started_at < policy.now - policy.max_age:
        return terminal(Reason.TOO_OLD, f"orphaned longer than {policy.max_age}; not resurrected")
    cap = c.max_attempts or policy.max_attempts
    if c.attempts >= cap:
        return terminal(Reason.LIMIT_REACHED, f"already recovered {c.attempts} of {cap} times")
    return Decision(
        c.task_id,
        Action.RECOVER,
        Reason.RECOVERABLE,
        evidence,
        f"recovery {c.attempts + 1} of {cap}",
        c.attempts + 1,
    )


def defer_excess(decisions: list[Decision], limit: int | None) -> list[Decision]:
    """Keep the first ``limit`` recoveries (callers order oldest first); defer the rest to a later sweep."""
    if limit is None:
        return decisions
    kept = 0
    result = []
    for d in decisions:
        if d.action is Action.RECOVER and d.reason is not Reason.ALREADY_SENT:
            if kept >= limit:
                d = Decision(
                    d.task_id,
                    Action.LEAVE,
                    Reason.DEFERRED,
                    d.evidence,
                    f"over the limit of {limit} recoveries per sweep",
                )
            else:
                kept += 1
        result.append(d)
    return result


def by_operator(decision: Decision) -> Decision:
    """An operator closes an orphan: whatever would have been done, it is marked terminal instead."""
    if not decision.orphaned or decision.action not in {Action.RECOVER, Action.MARK_TERMINAL}:
        return decision
    return Decision(
        decision.task_id,
        Action.MARK_TERMINAL,
        Reason.BY_OPERATOR,
        decision.evidence,
        "marked terminal by an operator",
        decision.attempt if decision.action is Action.MARK_TERMINAL else (decision.attempt or 1) - 1,
    )
