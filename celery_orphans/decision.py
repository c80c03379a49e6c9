"""What a decision says: what to do with a task (``Action``), why (``Reason``), what proved its worker alive
or gone (``Evidence``), and the ``Decision`` itself. ``rules.py`` reaches it; everything that acts on
a decision, reports it or counts it reads these words. No I/O happens here.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


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
    LEASE_LAPSED = (
        "lease_lapsed"  # that boot's lease is gone: the boot gave up what it ran (worker/forfeit.py)
    )
    PROCESS_EXITED = "process_exited"  # a process on its machine saw that boot's process exit
    PRESENCE_LOST = "presence_lost"  # Redis dropped its process's presence, and it did not renew since
    WORKER_ANSWERED_WITHOUT_TASK = "worker_answered_without_task"
    NO_REPLY_LEASE_FRESH = "no_reply_lease_fresh"
    NO_REPLY_NO_LEASE = "no_reply_no_lease"
    FOUND_AT_BOOT = "found_at_boot"  # the worker's next boot found it among its own name's tasks
    POOL_CHILD_LOST = "pool_child_lost"  # its pool process died (often the OOM killer); the worker lived
    BROKER_REDELIVERED = "broker_redelivered"  # the broker delivered it again over its unreleased entry
    CAP_LIFTED = "cap_lifted"  # marked terminal at its cap, which an operator lifted: nothing runs it
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
        Evidence.PRESENCE_LOST,
        Evidence.NO_REPLY_NO_LEASE,
        Evidence.FOUND_AT_BOOT,
        Evidence.POOL_CHILD_LOST,
        Evidence.BROKER_REDELIVERED,
        Evidence.CAP_LIFTED,
    }
)


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
