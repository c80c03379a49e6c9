"""The outbox's own connection to one ledger's Redis: the writes sent on it without waiting for their
answers, and what each answer, once read, says of the entry it wrote (``outbox.py`` reads them)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import redis

from celery_orphans import logs, scripts
from celery_orphans.entry import Entry
from celery_orphans.ledger import Admission, Ledger, Terms
from celery_orphans.worker import admission_line, bounded, lifecycle

if TYPE_CHECKING:
    from redis.connection import AbstractConnection

logger = logs.get(__name__)

# How the outbox's own connection shows in Redis's CLIENT LIST.
OUTBOX_CLIENT_NAME = "celery-orphans-outbox"


def connect(ledger: Ledger, seconds: float | None = None) -> AbstractConnection:
    """A connection of the outbox's own to ``ledger``'s Redis, connected, its scripts loaded; given
    ``seconds``, within them or ``redis.RedisError`` (``bounded.NotSent`` when it could not be made).

    The worker's main loop makes it for a first-hand delivery, and gives it what is left of the boot's
    validity: through the client, a link gone dark held the loop for its connect timeout (5 s), and
    through Redis Sentinel for each sentinel's socket timeout first (``bounded.py``)."""
    if seconds is not None:
        line = bounded.Line(ledger.client, OUTBOX_CLIENT_NAME)
        [loaded] = line.execute([(b"SCRIPT", b"LOAD", scripts.ADMIT)], seconds)
        if isinstance(loaded, redis.RedisError):
            line.close()
            raise loaded
        return line.detach()
    ledger.load_scripts()
    pool = ledger.client.connection_pool
    # No health check: its PING would read an answer owed to an earlier write. A connection
    # found dead has those writes made again, the slow way (Outbox._lost), and the line is made anew.
    conn: AbstractConnection = pool.connection_class(
        **{**pool.connection_kwargs, "health_check_interval": 0, "client_name": OUTBOX_CLIENT_NAME}
    )
    # Connect now, as the pool would: a Sentinel-managed connection asks the sentinels for the
    # master only in connect(). Left to connect on its first command, redis-py (8.x) opens it to
    # its default address, localhost:6379, whatever the ledger's URL says.
    conn.connect()
    return conn


@dataclass
class Line:
    """A connection of the outbox's own to one ledger's Redis, and the writes whose answers are owed;
    ``sending`` is held to send on it or close it, never to read, so a write goes while answers are due."""

    ledger: Ledger
    conn: AbstractConnection
    owed: list[Write] = field(default_factory=list)
    sending: threading.Lock = field(default_factory=threading.Lock)
    lost: bool = False


@dataclass(frozen=True)
class Write:
    """An entry sent without waiting, the removals it carried, the lease of the boot that wrote it, and
    who hears whether Redis recorded it (``True``) or refused it (``False``)."""

    entry: Entry
    releases: list[tuple[str, str]]
    lease: str
    on_answer: Callable[[bool], None] | None = None

    def answered(self, recorded: bool) -> None:
        if self.on_answer is not None:
            self.on_answer(recorded)


def redo(ledger: Ledger, write: Write) -> None:
    """Make ``write`` again the slow way, waiting for its answer: its line was lost or Redis restarted.

    The wait is bounded by what is left of the boot's validity, as the main loop's other ledger calls
    (``admission_line``): past it the lease may lapse, and a write that reached Redis then would be
    refused anyway (the script finds the boot gone). A write with no answer in time is not recorded."""
    terms = Terms(lease=write.lease)  # the terms it was sent with: made twice, it leaves the same entry
    heartbeat = lifecycle.current()
    try:
        if heartbeat is None:  # a process without a heartbeat: the client's own timeouts
            answer = ledger.admit_delivery(write.entry, write.releases, terms)
        else:
            answer = admission_line.admit(ledger, write.entry, write.releases, terms, heartbeat.time_left())
    except redis.RedisError as exc:
        not_recorded(write, exc)
        return
    check(write, answer)


def not_recorded(write: Write, exc: Exception) -> None:
    entry = write.entry
    write.answered(False)
    logger.warning(
        "cannot record %s[%s] in the ledger: %s; it runs, but could not be recovered if its worker died",
        entry.task_name,
        entry.task_id,
        exc,
    )


def check(write: Write, answer: Admission) -> None:
    entry = write.entry
    if answer.given_back:
        # Its message went back to the broker (a requeue, a shutdown's cancel) before the write reached
        # Redis: there is nothing to record.
        logger.debug("%s[%s] was given back before its entry reached Redis", entry.task_name, entry.task_id)
        return
    if answer.writer_gone:
        not_recorded(write, redis.ResponseError("its boot's lease had lapsed when the write reached Redis"))
        return
    write.answered(True)
    if not answer.admitted:
        # Only a caller sending one task id twice gets here: its other copy was recovered or closed.
        logger.warning(
            "%s[%s] runs although its fence has moved past this copy; was the same task id sent twice?",
            entry.task_name,
            entry.task_id,
        )
