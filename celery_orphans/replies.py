"""What the ledger's scripts answer, read into values: a delivery's admission, a task's fence, a lift of
its cap (``ledger.py`` asks; ``scripts/`` holds the Lua)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from celery_orphans.entry import Entry, Unreadable, parse


@dataclass(frozen=True)
class Admission:
    """What admitting a delivery found, in the one call that recorded it."""

    admitted: bool  # False: a stale copy or a duplicate, to drop
    checkpoint: bool = False  # the task has a checkpoint
    attempts: int = 0  # the fence's recovery count, this delivery's included
    redelivered: bool = False  # it re-delivers an orphan's copy, and was counted as a recovery
    limit_reached: bool = False  # it re-delivers an orphan's copy, but the count had reached the cap
    duplicate: bool = False  # a copy of an execution that is alive: never run it
    # Not written: the writing boot's lease had lapsed when the write reached Redis (held up on the way),
    # so an entry would name a boot the sweep judges gone. Nothing was recorded, as with a refused write.
    writer_gone: bool = False
    # Not written: its token was made void by the hand-back of a delivery that carried it (HAND_BACK): the
    # write reached Redis after its worker gave the message back.
    given_back: bool = False
    # The entry of the same copy it found: the execution that lost the task, or the live one it duplicates.
    previous: Entry | Unreadable | None = None


@dataclass(frozen=True)
class Fence:
    """A task's fence: the recoveries made, and the token of the entry the latest one claimed and sent."""

    attempts: int = 0
    claimed: str | None = None
    sent: str | None = None
    lifted: int = 0  # the count an operator lifted the task's cap to (0: never lifted)

    def sent_again(self, entry: Entry) -> bool:
        return bool(entry.token) and self.sent == entry.token

    def claimed_by_latest(self, entry: Entry) -> bool:
        return bool(entry.token) and self.claimed == entry.token


# The fence of a task no recovery has touched.
NO_FENCE = Fence()


@dataclass(frozen=True)
class Lift:
    """What lifting a task's cap found: ``done`` 1 lifted, 0 not marked terminal (or its window passed),
    -1 marked terminal without its message kept; the recovery count its fence holds."""

    done: int
    attempts: int

    @property
    def lifted(self) -> bool:
        return self.done == 1


def admission(task_id: str, reply: list[Any]) -> Admission:
    """What the admit script answered about the delivery of ``task_id``."""
    written, attempts, redelivered, *found = reply
    return Admission(
        admitted=int(written) in (1, 2),
        checkpoint=int(written) == 2,
        attempts=int(attempts),
        redelivered=int(redelivered) == 1,
        limit_reached=int(redelivered) == 2,
        duplicate=int(written) == 3,
        writer_gone=int(written) == 4,
        given_back=int(written) == 5,
        previous=parse(task_id, b"", found[0] if found else None),
    )


def fence_of(
    attempts: bytes | None, claimed: bytes | None, sent: bytes | None, lifted: bytes | None
) -> Fence:
    """A task's fence from the fields ``LOAD`` read of it."""
    if attempts is None and claimed is None and sent is None and lifted is None:
        return NO_FENCE  # most tasks were never recovered: one value serves them all
    return Fence(
        attempts=int(attempts) if attempts is not None else 0,
        claimed=claimed.decode() if claimed else None,
        sent=sent.decode() if sent else None,
        lifted=int(lifted) if lifted is not None else 0,
    )
