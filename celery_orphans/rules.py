"""The decision: observations in, one decision per candidate out. No I/O happens here.

A candidate is a task that some record says is running: a STARTED ``TaskResult`` row, a ledger entry, or
both. The sweep gathers what it could observe about each one (its row, its entry, its worker's answer to
one broadcast, the worker's lease, the recovery count) and this module decides what to do.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta

from celery_orphans.decision import ORPHAN_EVIDENCE, Action, Decision, Evidence, Reason
from celery_orphans.observations import Candidate, WorkerView

READY_STATES = frozenset({"SUCCESS", "FAILURE", "REVOKED", "IGNORED"})
# How far ahead of the sweep's clock a recorded start may be and still count as "just started": hosts
# synchronised by NTP differ by far less. Beyond it the start time itself cannot be believed.
CLOCK_TOLERANCE = timedelta(seconds=5)
# How long a message its worker handed back to the broker (a shutdown, a requeue) is left to the broker to
# deliver again before the ledger's copy counts as the only one: a hand-back that never reached the broker
# is recovered after this long.
HAND_BACK_GRACE = timedelta(minutes=5)


# Content types whose bodies are data, never code: what Celery's json and msgpack serializers write, and
# nothing else (YAML loaders have run code; a raw "application/data" body is bytes nobody vouched for).
# A message of any other type is never sent again.
SAFE_CONTENT_TYPES = frozenset({"application/json", "application/x-msgpack"})


@dataclass(frozen=True)
class Limits:
    """What bounds a decision: the clock it judges by, the grace period, the default recovery cap, the
    groups switched on or off, how old an orphan may be and still be sent again. (A task's own
    ``@recoverable`` options are its recovery policy, in ``registry``.)

    ``grace`` spares a task whose boot is known gone (nothing of it is still being written);
    ``min_age``, an operator's ``--grace-minutes``, spares no task younger than itself."""

    now: datetime
    grace: timedelta
    max_attempts: int
    groups: Mapping[str, bool]
    max_age: timedelta | None = None
    min_age: timedelta = timedelta(0)


def decide(candidate: Candidate, worker: WorkerView | None, limits: Limits) -> Decision:
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
    w = worker or WorkerView(replied=False)
    # The grace keeps a task's records from being judged while they are being written. A task whose
    # ledger entry names a boot known gone needs none: that boot's lease was written before the entry.
    # Nor does its start time matter then: the boot's end is read by Redis's clock, whatever the clock
    # of the worker that wrote the start.
    boot_gone = c.boot is not None and not w.at_boot and c.boot in w.gone_boots
    boot_gone = boot_gone or c.lift_unused  # no execution at all: nothing of it is being written
    if c.started_at > limits.now + CLOCK_TOLERANCE and not boot_gone:
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
    in_grace = c.started_at > limits.now - limits.grace and not boot_gone
    if in_grace or (limits.min_age and c.started_at > limits.now - limits.min_age):
        return Decision(c.task_id, Action.LEAVE, Reason.IN_GRACE)
    if c.handed_back_at is not None and c.handed_back_at > limits.now - HAND_BACK_GRACE:
        return Decision(
            c.task_id,
            Action.LEAVE,
            Reason.HANDED_BACK,
            detail=f"its worker gave the message back to the broker at {c.handed_back_at.isoformat()}",
        )
    evidence = judge(c, w)
    if evidence not in ORPHAN_EVIDENCE:
        return Decision(c.task_id, Action.LEAVE, Reason.ALIVE, evidence)
    return _act_on_orphan(c, evidence, limits)


def judge(candidate: Candidate, worker: WorkerView) -> Evidence:
    """Alive or gone: from the lease of the boot that runs it, or from its worker's answer.

    A ledger entry names the worker boot that runs the task. While that boot holds its lease it is alive;
    once the lease is gone the boot has given up what it ran (a worker stops its executions before its
    lease can lapse: ``worker/forfeit.py``), so no question need be asked. A task known from its result row
    alone may be run by any boot of its node name, or by a worker that holds no lease at all (fail open):
    that node's answer decides, and without one, its leases. A booting worker's own view is exact for
    the earlier boots of its name, but for one still alive by its lease: a twin of its name, which runs
    what its entries name.
    """
    c, w = candidate, worker
    if c.lift_unused:
        # Marked terminal at its cap, every copy dropped since: its entry is a message nobody runs, whatever
        # the boot it names (often alive: a pool process died under it) says of itself.
        return Evidence.CAP_LIFTED
    if w.at_boot:
        if c.task_id in w.held:
            return Evidence.WORKER_HOLDS_TASK
        # A boot its entry names that is alive by its lease runs it, though not this one: a twin of its name.
        return (
            Evidence.BOOT_ALIVE if c.boot is not None and c.boot in w.fresh_boots else Evidence.FOUND_AT_BOOT
        )
    if c.boot is not None:
        if c.boot not in w.fresh_boots:
            if c.boot in w.exited_boots:
                return Evidence.PROCESS_EXITED
            return Evidence.PRESENCE_LOST if c.boot in w.presence_lost_boots else Evidence.LEASE_LAPSED
        held = w.answers_for(c.task_id) and c.task_id in w.held
        return Evidence.WORKER_HOLDS_TASK if held else Evidence.BOOT_ALIVE
    if w.answers_for(c.task_id):
        return Evidence.WORKER_HOLDS_TASK if c.task_id in w.held else Evidence.WORKER_ANSWERED_WITHOUT_TASK
    return Evidence.NO_REPLY_LEASE_FRESH if w.fresh_boots else Evidence.NO_REPLY_NO_LEASE


def asks_about(candidate: Candidate, now: datetime, grace: timedelta) -> bool:
    """Whether the sweep's broadcast asks the candidate's node about it: a task only its result row knows
    of, past its grace, whose decision its node's answer can change.

    A row no answer settles (a task not registered here, no start time) is reported whatever its node
    says, so its node is not asked about it: nodes without a live boot are asked (``worth_asking``), and
    such a row, never marked, had every sweep wait out its dead node's silence before deciding anything.
    """
    c = candidate
    if not c.worker or c.boot is not None or c.problem:
        return False
    if not c.task_name or not c.task_known or c.started_at is None:
        return False
    return c.started_at <= now - grace


def worth_asking(alive: frozenset[str], gone: frozenset[str], exited: frozenset[str]) -> bool:
    """Whether a node is asked about the tasks only its result rows know of, given its boots.

    A node with a live boot is asked. So is a node without one: a live worker cut off from its ledger
    (fail open) holds no lease, yet runs what it received, and its broker still carries the question; a
    task whose row names it is judged only once it does not answer or answers without the task. The
    exception is a node whose every recorded boot was seen to exit (by a process on its machine): the
    kernel said it is gone, and waiting out its silence would hold up the sweep's other decisions.
    """
    return bool(alive) or not gone or gone != exited


def after_pool_loss(candidate: Candidate, limits: Limits) -> Decision:
    """The worker saw the pool process running this task die: recover it, within the same cap."""
    return _act_on_orphan(candidate, Evidence.POOL_CHILD_LOST, limits)


def after_redelivery(candidate: Candidate, limits: Limits, *, limit_reached: bool) -> Decision:
    """The broker delivered an orphan's message again and the ledger counted it, or found the cap reached.

    ``candidate.attempts`` is the count before this delivery. The broker has already sent the task
    again, so only the cap can stop it: a group switched off or an unsafe message governs what a
    sweep sends, not what the broker does.
    """
    c, cap, evidence = candidate, cap_of(candidate, limits), Evidence.BROKER_REDELIVERED
    if limit_reached:
        detail = f"already recovered {c.attempts} of {cap} times"
        return Decision(c.task_id, Action.MARK_TERMINAL, Reason.LIMIT_REACHED, evidence, detail, c.attempts)
    detail = f"recovery {c.attempts + 1} of {cap}, delivered again by the broker"
    return Decision(c.task_id, Action.RECOVER, Reason.RECOVERABLE, evidence, detail, c.attempts + 1)


def _act_on_orphan(c: Candidate, evidence: Evidence, limits: Limits) -> Decision:
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
    if c.group is not None and not limits.groups.get(c.group, True):
        return terminal(Reason.GROUP_DISABLED, f"recovery of group {c.group!r} is switched off")
    if not c.has_entry:
        return terminal(Reason.NO_LEDGER_ENTRY, "no ledger entry holds the message to send again")
    if c.content_type not in SAFE_CONTENT_TYPES:
        return terminal(Reason.UNSAFE_MESSAGE, f"a {c.content_type or 'untyped'} message is never sent again")
    if limits.max_age is not None and c.started_at is not None and c.started_at < limits.now - limits.max_age:
        return terminal(Reason.TOO_OLD, f"orphaned longer than {limits.max_age}; not resurrected")
    cap = cap_of(c, limits)
    if c.attempts >= cap:
        return terminal(Reason.LIMIT_REACHED, f"already recovered {c.attempts} of {cap} times")
    lifted = " (its cap lifted by an operator)" if c.lifted > (c.max_attempts or limits.max_attempts) else ""
    return Decision(
        c.task_id,
        Action.RECOVER,
        Reason.RECOVERABLE,
        evidence,
        f"recovery {c.attempts + 1} of {cap}{lifted}",
        c.attempts + 1,
    )


def cap_of(candidate: Candidate, limits: Limits) -> int:
    """How many recoveries the task is allowed: its own cap, else the default, unless an operator lifted
    it past that once it was reached (each lift allows one recovery more than the count then held)."""
    return max(candidate.max_attempts or limits.max_attempts, candidate.lifted)


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
