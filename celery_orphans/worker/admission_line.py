"""The ledger calls the worker's main loop waits for, each bounded by what is left of the boot's validity.

The admission of a delivery that waits for its verdict, the fence read of one that runs without a
recorded entry (``stale``), the removal of a finished task's entry that must go before the next task
(``release_many``, for the outbox), and the mark of an entry whose message goes back to the broker
(``hand_back``).

A redelivery, a recovered copy, and every delivery while the last renewal was not answered wait for the
admit script's verdict before they run. Through the ledger's own client that wait is its socket timeout,
tried again: against a link gone dark, many seconds in which the worker's main loop fetches nothing,
acknowledges nothing and answers no broadcast. On a connection of its own (``bounded.py``) the call gives
up when the boot's lease may lapse in Redis: a write that reaches Redis after that is refused (the script
finds the boot gone), so a longer wait could learn nothing. A verdict that comes before then but after the
boot's validity ended is still read: the delivery is dropped, and recovered from its entry.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import redis

from celery_orphans import scripts
from celery_orphans.entry import Entry
from celery_orphans.ledger import Admission, Ledger, Terms, admission
from celery_orphans.worker.bounded import Line, NotSent

# How the connection shows in Redis's CLIENT LIST.
ADMISSION_CLIENT_NAME = "celery-orphans-admission"

_line: Line | None = None
# One call at a time on the line's one connection: on the threads, gevent and eventlet pools a task's
# acknowledgement, and with it a removal made at once (``release_many``), runs beside the main loop.
_using = threading.Lock()


def admit(
    ledger: Ledger, entry: Entry, releases: Sequence[tuple[str, str]], terms: Terms, seconds: float
) -> Admission:
    """``ledger.admit_delivery``, answered within ``seconds``; ``redis.TimeoutError`` (or
    ``redis.ConnectionError``) once they are spent or the connection failed."""
    command = ledger.admit_command(entry, releases, terms)
    deadline = time.monotonic() + seconds
    # Never sent twice: a failure is a write that may or may not have landed, and the caller decides (a
    # message delivered before goes back to the broker, its entry marked and its token made void first:
    # ``HAND_BACK``).
    reply = _execute(ledger, command, seconds)
    if isinstance(reply, redis.exceptions.NoScriptError):  # Redis lost its scripts (a restart)
        reply = _execute(ledger, (b"EVAL", scripts.ADMIT, *command[2:]), deadline - time.monotonic())
    if isinstance(reply, redis.RedisError):
        raise reply
    return admission(entry.task_id, reply)


def stale(ledger: Ledger, entry: Entry, seconds: float) -> bool:
    """``ledger.stale(entry)``, answered within ``seconds``; ``redis.RedisError`` as ``admit``."""
    return bool(_call(ledger, ledger.stale_command(entry), seconds))


def release_many(ledger: Ledger, releases: list[tuple[str, str]], seconds: float) -> int:
    """``ledger.release_many(releases)``, answered within ``seconds``; ``redis.RedisError`` as ``admit``.
    A removal is made only while its entry carries its token: one sent again after a failure is harmless."""
    return int(_call(ledger, ledger.release_many_command(releases), seconds)) if releases else 0


def hand_back(ledger: Ledger, task_id: str, token: str, seconds: float) -> bool:
    """``ledger.hand_back``, answered within ``seconds``; ``redis.RedisError`` as ``admit``."""
    return bool(_call(ledger, ledger.hand_back_command(task_id, token), seconds))


def _call(ledger: Ledger, command: tuple[Any, ...], seconds: float) -> Any:
    reply = _execute(ledger, command, seconds)
    if isinstance(reply, redis.RedisError):
        raise reply
    return reply


def _execute(ledger: Ledger, command: tuple[Any, ...], seconds: float) -> Any:
    """``command``'s reply (an error reply as its exception), within ``seconds``, waiting for the line
    included."""
    deadline = time.monotonic() + seconds
    if not _using.acquire(timeout=max(0.0, seconds)):
        raise NotSent("the ledger's bounded connection stayed busy")
    try:
        [reply] = _line_to(ledger).execute([command], deadline - time.monotonic())
        return reply
    finally:
        _using.release()


def _line_to(ledger: Ledger) -> Line:
    global _line
    if _line is None or _line.client is not ledger.client:
        _line = Line(ledger.client, ADMISSION_CLIENT_NAME)
    return _line
