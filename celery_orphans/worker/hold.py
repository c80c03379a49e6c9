"""Deliveries given back to the broker unrun because the ledger cannot record them, and for how long.

A message is given back (``AdmittedRequest._orphans_hold``) when its admission was not recorded: a message
delivered before may have an earlier delivery's entry a sweep can recover the task from, and a delivery
run unrecorded is lost, marked ``FAILURE``, if its worker dies. While the trouble is the worker's own (no
lease held, its entries refused), it is held for as long as that trouble is younger than
``LEDGER_HOLD_SECONDS``; past it, deliveries run unprotected (fail open), so that a long outage does not
stop the work.

A message given back is often delivered again at once, so each hand-back waits on the worker's main loop
first (``later``), twice as long as the last, up to a heartbeat: a ledger that fails at once (a refused
connection) does not have the broker deliver it in a tight loop, and while the trouble is the worker's,
the worker keeps what it prefetched instead of cycling the whole queue through the broker. Only the first
hand-back of a task, and of a worker-wide trouble, is a warning.

The state is the worker's main process's: one ``Holds`` per process (``holds``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import redis
from kombu.asynchronous import get_event_loop
from kombu.utils.compat import detect_environment

from celery_orphans import logs
from celery_orphans.conf import settings
from celery_orphans.ledger import Ledger
from celery_orphans.worker import admission_line
from celery_orphans.worker.heartbeat import Heartbeat

logger = logs.get(__name__)

FIRST_WAIT_SECONDS = 0.05
REMEMBERED = 1000  # tasks whose next wait is kept; forgotten all at once past it


class Holds:
    """The hand-backs of one worker process and its trouble with its ledger."""

    def __init__(self) -> None:
        # Each task given back, with how long its next hand-back waits.
        self._waits: dict[str, float] = {}
        # Since when (time.monotonic()) the ledger has refused this process's entries, none recorded since:
        # the heartbeat's renewal meets a refusal up to a heartbeat later.
        self.refused_since: float | None = None
        self._refused_last = 0.0  # a refusal after a quiet gap of two heartbeats starts the count again
        self._failing_open = False  # the hold ran out: said once per trouble
        self._worker_wait = 0.0  # the next wait while the trouble is the worker's (0: none yet)
        self._worker_said = False
        # The token of each task given back unmarked after its write got no answer (Redis refused the
        # mark): Redis may have written its entry, which its next delivery here then writes over.
        self._unmarked: dict[str, str] = {}

    def refused(self) -> None:
        """The ledger refused an entry of this process (from the main loop or the outbox's thread)."""
        now = time.monotonic()
        if self.refused_since is None or now - self._refused_last > 2 * settings.HEARTBEAT_SECONDS:
            self.refused_since = now
        self._refused_last = now

    def recorded(self, task_id: str, *, answered: bool) -> None:
        """``task_id`` was admitted; ``answered``: its entry is known to be recorded, so the trouble ended."""
        self._waits.pop(task_id, None)
        if self._worker_wait:
            self._worker_wait, self._worker_said = 0.0, False
        if answered:
            self.refused_since, self._failing_open = None, False

    def unmarked(self, task_id: str, token: str) -> None:
        """``task_id`` goes back to the broker unmarked: its write, made with ``token``, got no answer, and
        Redis refused the mark (which, answered, makes the token void instead: ``HAND_BACK``)."""
        if len(self._unmarked) >= REMEMBERED:
            self._unmarked.clear()
        self._unmarked[task_id] = token

    def token_for(self, task_id: str, boot: str) -> str | None:
        """The token of ``task_id``'s write given back unmarked, if ``boot`` made it; forgotten once asked
        for."""
        token = self._unmarked.pop(task_id, None)
        return token if token is not None and token.startswith(f"{boot}.") else None

    def holding(self, heartbeat: Heartbeat) -> bool:
        """Whether a delivery that cannot be recorded goes back to the broker unrun: while this worker's
        trouble with its ledger (its renewals unanswered or refused, no lease held, its entries refused) is
        younger than ``LEDGER_HOLD_SECONDS``."""
        refused = 0.0 if self.refused_since is None else time.monotonic() - self.refused_since
        lasted = max(heartbeat.trouble_seconds(), refused)
        limit = settings.LEDGER_HOLD_SECONDS
        if lasted < limit:
            self._failing_open = False
            return True
        if not self._failing_open:
            self._failing_open = True
            logger.warning(
                "worker %s cannot record its deliveries in the ledger for %.1fs (LEDGER_HOLD_SECONDS is %g): "
                "the recoverable tasks it receives run unprotected until its ledger records them again",
                heartbeat.node,
                lasted,
                limit,
            )
        return False

    def wait_before(self, name: str, task_id: str, why: str, *, worker_wide: bool) -> float:
        """How long the hand-back of ``task_id`` waits (0: none, its first), logged; ``worker_wide``: the
        trouble is the worker's, not this message's."""
        wait = self._waits.get(task_id)
        if len(self._waits) >= REMEMBERED:
            self._waits.clear()
        most = settings.HEARTBEAT_SECONDS
        self._waits[task_id] = min(most, 2 * wait) if wait else FIRST_WAIT_SECONDS
        level = logging.DEBUG if wait else logging.WARNING
        if worker_wide:
            self._worker_wait = min(most, 2 * self._worker_wait) if self._worker_wait else FIRST_WAIT_SECONDS
            wait = max(wait or 0.0, self._worker_wait)
            if not self._worker_said:
                self._worker_said = True
                logger.warning(
                    "cannot record deliveries in the ledger (%s): they go back to the broker unrun until "
                    "they can be, for up to %gs of trouble (LEDGER_HOLD_SECONDS)",
                    why,
                    settings.LEDGER_HOLD_SECONDS,
                )
            level = logging.DEBUG
        logger.log(level, "gave %s[%s] back to the broker unrun: %s", name, task_id, why)
        return wait or 0.0


holds = Holds()


def give_back_marked(
    ledger: Ledger,
    task_id: str,
    token: str,
    heartbeat: Heartbeat,
    wait: float,
    give_back: Callable[[], object],
) -> None:
    """``give_back()`` a message whose write, made with ``token``, got no answer, once the entry Redis may
    have written for it is marked handed back (``HAND_BACK``: a message given back by its worker), so
    that no worker the broker delivers it to takes it for a duplicate of a live execution and drops it,
    and ``token`` made void, so that the write, should Redis read it only now, writes nothing.
    The mark is tried in ``wait`` seconds, then again, waiting twice as long each time up to a heartbeat,
    while the link gives no answer; the message stays with this worker meanwhile, unrun. It goes back
    unmarked once the boot that wrote the entry was given up: a sweep may then recover the task from it.
    """
    generation = heartbeat.generation

    def attempt(wait: float) -> None:
        if heartbeat.generation == generation:
            try:
                admission_line.hand_back(ledger, task_id, token, heartbeat.time_left())
            except (redis.ConnectionError, redis.TimeoutError):
                wait = min(settings.HEARTBEAT_SECONDS, 2 * wait)
                if later(wait, attempt, wait):
                    return
            except redis.RedisError:
                # Refused: nothing was marked, as when Redis refuses the mark of a requeue, and the token is
                # not void: delivered here again, the message is written with it, over what it left.
                holds.unmarked(task_id, token)
        give_back()

    if not later(max(wait, FIRST_WAIT_SECONDS), attempt, max(wait, FIRST_WAIT_SECONDS)):
        attempt(FIRST_WAIT_SECONDS)


def later(seconds: float, call: Callable[..., object], *args: object) -> bool:
    """Call ``call(*args)`` in ``seconds`` on the worker's main loop without holding it up: its event loop,
    or a greenlet on the gevent and eventlet pools, which have none; ``False`` where neither is found."""
    hub = get_event_loop()
    if hub is not None:
        hub.call_later(seconds, call, *args)
        return True
    environment = detect_environment()
    if environment == "gevent":
        import gevent  # type: ignore[import-untyped]

        gevent.spawn_later(seconds, call, *args)
        return True
    if environment == "eventlet":
        import eventlet  # type: ignore[import-untyped]

        eventlet.spawn_after(seconds, call, *args)
        return True
    return False
