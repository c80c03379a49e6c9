"""When the broker delivers again the message of a task whose execution died unacknowledged.

RabbitMQ puts a dead worker's unacknowledged messages back in the queue at once (the Redis transport
after ``visibility_timeout``), so a worker runs the task again before any sweep can judge it, and a task
that kills its worker every time would run for ever. The ledger's admit finds the unreleased entry of the
lost execution and counts the delivery as a recovery, under the same cap as every other (``ADMIT``
in scripts/delivery.py); the worker records it, and once the cap is reached marks the task terminal instead of
running it, as it does when a pool process is lost.
"""

from __future__ import annotations

import functools
from typing import Any

import redis
from django.db import DatabaseError

from celery_orphans import logs, registry
from celery_orphans.conf import settings
from celery_orphans.entry import HEADER, Entry, Unreadable
from celery_orphans.ledger import Admission
from celery_orphans.recovery import audit, rows
from celery_orphans.rules import after_redelivery
from celery_orphans.worker import lifecycle
from celery_orphans.worker.takeover import take_over

logger = logs.get(__name__)


def first_hand(request: Any) -> bool:
    """Whether the broker delivers ``request``'s message for the first time, so it needs no fence check.

    A copy of a task is recovered or marked terminal only after a delivery of it was recorded, so a
    message never delivered before cannot have been overtaken, and is no redelivery to count. The broker
    must say so: RabbitMQ marks what it delivers again, and so does kombu's Redis transport when it
    restores a message (past its visibility timeout, at a shutdown, on a reject). Other transports do
    not, and every delivery of theirs is checked. A message with an ETA is checked too: a transport that
    restores one a worker holds past its visibility timeout hands a second worker a copy that comes due
    at the same moment as the first. So is a message that carries this extension's header: a recovery's
    copy, which a sweep that crashed after publishing it, or a publish retried after the broker took it,
    may have sent twice; the admit drops the second (``ADMIT``).
    """
    return (
        not request.delivery_info.get("redelivered")
        and not request.eta
        and HEADER not in (request.message.headers or {})
        and marks_redeliveries(request.task.app)
    )


@functools.lru_cache(maxsize=8)
def marks_redeliveries(app: Any) -> bool:
    """Whether ``app``'s broker transport flags the messages it delivers again as ``redelivered``."""
    with app.connection_for_read() as conn:
        return conn.transport.driver_type in _MARKING_TRANSPORTS


_MARKING_TRANSPORTS = frozenset({"amqp", "redis"})


def finished(request: Any) -> bool:
    """Whether ``request``, a message the broker delivers again, is of a task whose result row already says
    it ended: its execution stored its outcome, and its acknowledgement was lost (a connection cut after
    the body ended, before the broker had the ack). Its entry was released with that acknowledgement, so
    the admission would take it for new and run the task twice; it is dropped instead. Read only for a
    message the broker marks redelivered, never on a first delivery's path. A task without a result row
    (``ignore_result``) has nothing to read, and runs again, as on plain Celery."""
    if request.task.ignore_result:
        return False
    try:
        status = rows.ended_as(request.id)
    except DatabaseError as exc:
        logger.error("could not read the result row of %s[%s]: %s", request.name, request.id, exc)
        return False
    if status is None:
        return False
    logger.warning(
        "dropped a redelivery of %s[%s]: its result row already says %s (its acknowledgement was lost)",
        request.name,
        request.id,
        status,
    )
    return True


def limits(request: Any) -> tuple[int, int]:
    """The cap the admit counts a redelivery of ``request`` against (0: count none), and the count's TTL."""
    policy = registry.policy_of(request.task)
    if policy is None or not single_flight():
        return 0, 0
    return policy.max_attempts or settings.MAX_ATTEMPTS, settings.ATTEMPTS_WINDOW_SECONDS


def single_flight() -> bool:
    """Whether a delivery of an execution that is alive is dropped: when recovery is on, for real."""
    return settings.ENABLED and not settings.SHADOW_MODE


def drop_duplicate(request: Any, running: Entry | Unreadable | None) -> None:
    """Log and audit a delivery dropped because ``running``, an execution that is alive, has the task.

    The live execution's entry holds the exact message: should its worker die later, the task is
    recovered from it as usual. The delivery is no recovery, and is not counted as one.
    """
    owner = f"{running.node} (boot {running.boot})" if isinstance(running, Entry) else "a live worker"
    logger.warning(
        "dropped a duplicate of %s[%s]: the same message is running on %s",
        request.name,
        request.id,
        owner,
    )
    heartbeat = lifecycle.current()
    try:
        audit.record_duplicate(request.id, request.name, heartbeat.node if heartbeat else "", owner)
    except DatabaseError as exc:
        logger.error("could not audit the duplicate of %s[%s]: %s", request.name, request.id, exc)


def handle_counted(request: Any, admission: Admission) -> bool:
    """Record a counted redelivery, or mark the task terminal at the cap; ``True``: do not run it."""
    heartbeat = lifecycle.current()
    if heartbeat is None:
        return False
    before = admission.attempts - 1 if admission.redelivered else admission.attempts
    decide = functools.partial(after_redelivery, limit_reached=admission.limit_reached)
    try:
        lost_on = admission.previous.node if isinstance(admission.previous, Entry) else None
        outcome = take_over(request, heartbeat, before, decide, lost_on)
    except (redis.RedisError, DatabaseError) as exc:
        # The count stands in the fence; only its record (or, at the cap, the terminal mark) is missing,
        # and the task runs, as it would have without celery-orphans.
        logger.error("could not record the redelivery of %s[%s]: %s", request.name, request.id, exc)
        return False
    return admission.limit_reached and outcome.done
