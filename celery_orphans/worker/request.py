"""The worker-side hook: a Celery ``Request`` class for recoverable tasks.

It runs in the worker's main process, where the delivered message is at hand. Before the pool gets a
task, the delivery is admitted (``admission.py``): recorded in the ledger, or dropped as stale or a
duplicate. Every end of an ``acks_late`` task passes through ``acknowledge()`` or ``reject()``, where
the entry is removed, or, when the message goes back to the broker, marked as handed back:

- a result, a failure, ``Retry`` (its next attempt already sent) and ``Ignore`` are acknowledged, and so is
  ``Task.replace()``, which sends the replacement under the same id and ends with ``Ignore``: removed;
- ``Reject(requeue=False)``: rejected, removed;
- ``Reject(requeue=True)`` and a cold shutdown's cancel: marked before the broker has the message back.

``Ignore`` and ``Reject`` store no state, so the row stays ``STARTED``: ``worker/ending.py`` records the
ending for the sweep to leave it alone (``endings.py``).
"""

from __future__ import annotations

import functools
import time
from typing import Any

from billiard.exceptions import Terminated, WorkerLostError
from celery.worker import state
from celery.worker.request import Request
from celery.worker.state import task_ready
from django.db import DatabaseError

from celery_orphans import logs
from celery_orphans.exceptions import ExecutionForfeit
from celery_orphans.ledger import ledger_for
from celery_orphans.recovery import rows
from celery_orphans.worker import admission_line, forfeit, lifecycle, pool_loss
from celery_orphans.worker.admission import AdmittedRequest
from celery_orphans.worker.outbox import outbox

logger = logs.get(__name__)


class RecoverableRequestMixin(AdmittedRequest):
    """Records the delivery before it runs, drops stale and duplicate copies (``admission.py``), and forgets
    it once done."""

    _orphans_forfeit: bool = False  # its boot gave it up: it ends without removing its entry
    # Its pool process found the generation holding when the body ended (it returned, or raised past the
    # forfeit check): its outcome stands, so its entry goes, however late the acknowledgement comes.
    _orphans_passed: bool = False
    _orphans_refused: bool = False  # ended as forfeit: acknowledged with its entry kept

    def _orphans_forfeited(self) -> bool:
        """Whether this execution's boot gave it up; its entry then stays, for the sweep to recover it.
        The pool process's verdict comes first: an execution that passed its forfeit check there stored its
        outcome, whatever the generation is by the time the main process hears of it."""
        if self._orphans_generation is None or self._orphans_passed:
            return False
        return self._orphans_forfeit or not forfeit.holds(self._orphans_generation)

    def _orphans_release(self) -> None:
        token, self._orphans_token = self._orphans_token, None
        if token is None or self._orphans_forfeited():
            return
        # Off the path from this acknowledgement to the next task (see outbox.py), unless no result row
        # will say the task ended: then its entry goes before anything else happens.
        # Now, bounded as the heartbeat's own calls are: a ledger gone dark holds the main loop no longer.
        outbox.release(
            self._orphans_ledger or ledger_for(),
            self.id,
            token,
            now=bool(self.task.ignore_result),
            seconds=_time_left(),
        )

    def _orphans_hand_back(self) -> None:
        """The message goes back to the broker: mark the entry, so no sweep takes it for an orphan."""
        token, self._orphans_token = self._orphans_token, None
        if token is None:
            return
        ledger = self._orphans_ledger or ledger_for()
        seconds = _time_left()
        with logs.redis_fault_let_go(
            logger, "cannot mark %s[%s] as handed back to the broker", self.name, self.id
        ):
            if seconds is None:
                outbox.settle()  # the entry was sent without waiting: it is in Redis once answered
                ledger.hand_back(self.id, token)
                return
            # Bounded as the heartbeat's own calls are: a ledger gone dark holds the main loop no longer.
            deadline = time.monotonic() + seconds
            outbox.settle(seconds)
            admission_line.hand_back(ledger, self.id, token, deadline - time.monotonic())

    def on_failure(self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False) -> None:
        exc = getattr(exc_info, "exception", None)
        if not isinstance(getattr(exc, "exc", exc), _NO_VERDICT):
            self._orphans_passed = True  # it raised past the forfeit check of its pool process
        if self._orphans_token is not None and self._orphans_forfeited():
            # Its boot gave it up (its pool process was killed for it, or it ended by ExecutionForfeit):
            # nothing is recorded over the execution that recovers it, and its entry stays.
            task_ready(self)
            if self._orphans_recorded is not True:
                # No entry is known to hold its message, so no sweep may recover it: the broker gets
                # it back. A write Redis refused left nothing to mark as handed back.
                if self._orphans_recorded is False:
                    self._orphans_token = None
                _row_handed_back(self)
                self.reject(requeue=True)
                return
            self._orphans_refused = True
            self.acknowledge()
            return
        if self._orphans_token is not None and pool_loss.recover_lost(self, exc_info):
            return
        super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)

    def cancel(self, *args: Any, **kwargs: Any) -> Any:
        # A cold shutdown cancels what runs; the broker gets the unacknowledged message back.
        if self.task.acks_late and not self.acknowledged:
            self._orphans_hand_back()
        return super().cancel(*args, **kwargs)

    def acknowledge(self) -> None:
        super().acknowledge()
        # Celery's own on_success (of the class its strategy makes from this one) marks a body that
        # returned, and so passed its forfeit check, before it acknowledges.
        if not self._orphans_refused and self.id in state.successful_requests:
            self._orphans_passed = True
        self._orphans_release()

    def reject(self, requeue: bool = False) -> None:
        if requeue:
            # Marked before the broker has the message back, as cancel() does: a worker it reaches at
            # once must find the entry handed back, not a live execution's.
            self._orphans_hand_back()
            super().reject(requeue)
            return
        super().reject(requeue)
        self._orphans_release()


def _row_handed_back(request: RecoverableRequestMixin) -> None:
    """Its row says ``STARTED`` while the broker has its message back and no entry is known to hold it: a
    sweep would take it for a task running without an entry on a worker that answers without it, and mark
    it ``FAILURE`` (revoking the copy the broker delivers next). It is moved to ``RETRY``, as a recovery
    moves the row of the copy it sends; the next execution writes ``STARTED`` again."""
    try:
        rows.mark_retry(
            request.id,
            "handed back to the broker: its worker gave it up before its ledger entry was recorded",
        )
    except DatabaseError as exc:
        logger.error("could not move the row of %s[%s] to RETRY: %s", request.name, request.id, exc)


def _time_left() -> float | None:
    """What a ledger call of the main loop may take: what is left of the boot's validity, as for the
    heartbeat's calls; ``None`` (the client's own timeouts) in a process without a heartbeat."""
    heartbeat = lifecycle.current()
    return heartbeat.time_left() if heartbeat is not None else None


# What the main process hears when the pool process did not let the execution's end stand: the forfeit check
# refused it, or the process died (killed at a forfeit, or lost) before the body ended.
_NO_VERDICT = (ExecutionForfeit, WorkerLostError, Terminated, SystemExit, KeyboardInterrupt)


@functools.cache
def recoverable_request_class(base: type[Request]) -> type[Request]:
    """``base`` with the recoverable hooks mixed in (a project's own Request class keeps working)."""
    if issubclass(base, RecoverableRequestMixin):
        return base
    return type(f"Recoverable{base.__name__}", (RecoverableRequestMixin, base), {})
