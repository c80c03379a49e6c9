"""The worker-side hook: a Celery ``Request`` class for recoverable tasks.

It runs in the worker's main process, where the delivered message is at hand. Celery calls
``Request.revoked()`` just before it hands a task to the pool; that is the last point at which a message
can be dropped without running it, so the ledger write, the fence check and the duplicate check happen
there. A first-hand delivery needs neither check, and its write goes out without waiting (``outbox.py``).
Every end of an ``acks_late`` task passes through ``acknowledge()`` or ``reject()``, where the entry is
removed, or, when the message goes back to the broker, marked as handed back.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import redis
from celery.worker.request import Request
from celery.worker.state import task_ready

from celery_orphans.checkpoints import NO_CHECKPOINT
from celery_orphans.entry import Entry
from celery_orphans.ledger import Ledger, ledger_for
from celery_orphans.worker import fence, heartbeat, pool_loss, redelivery
from celery_orphans.worker.fence import GENERATION
from celery_orphans.worker.heartbeat import Heartbeat
from celery_orphans.worker.outbox import outbox
from celery_orphans.worker.takeover import boot_ledger, entry_for

logger = logging.getLogger(__name__)


class RecoverableRequestMixin:
    """Records the delivery before it runs, drops stale and duplicate copies, and forgets it once done."""

    _orphans_checked: bool = False
    _orphans_token: str | None = None
    _orphans_ledger: Ledger | None = None
    _orphans_generation: int | None = None  # of the worker boot that admitted it (fence.py)
    _orphans_forfeit: bool = False  # its boot gave it up: it ends without removing its entry

    def revoked(self) -> bool:
        if super().revoked():  # type: ignore[misc]
            return True
        if self._orphans_checked:
            return False
        self._orphans_checked = True
        return not self._orphans_admit()

    def _orphans_admit(self) -> bool:
        req: Any = self
        beat = heartbeat.current()
        if beat is None or not req.task.acks_late:
            # Without a lease nothing could ever prove this worker dead, and without acks_late the
            # broker has already forgotten the message: there is nothing sound to record.
            return True
        token = beat.token()
        entry = entry_for(req, beat, token)
        # The ledger lives where this boot's lease does (its key prefix was read when the lease began),
        # found once per boot.
        self._orphans_ledger = current = boot_ledger(beat)
        if redelivery.first_hand(req) and self._orphans_send(current, entry, beat):
            return True
        releases = outbox.take(current)  # finished tasks' entries, removed by the same call
        cap, ttl = redelivery.limits(req)
        try:
            admission = current.admit_delivery(
                entry,
                releases,
                cap=cap,
                ttl=ttl,
                lease=beat.lease_key,
                single_flight=redelivery.single_flight(),
            )
        except redis.RedisError as exc:
            outbox.give_back(current, releases)
            # Fail open: the task runs, it just cannot be recovered if this worker dies.
            logger.warning("celery-orphans: cannot record %s[%s] in the ledger: %s", req.name, req.id, exc)
            return True
        if admission.duplicate:
            redelivery.drop_duplicate(req, admission.previous)
            self._orphans_drop()
            return False
        if not admission.admitted:
            self._orphans_drop_stale(entry)
            return False
        self._orphans_admitted(token, beat)
        if (admission.redelivered or admission.limit_reached) and redelivery.record(req, admission):
            self._orphans_drop()  # marked terminal: recovered as often as its cap allows
            return False
        if not admission.checkpoint:
            # Goes to the pool process with the request: no checkpoint to remove when the task
            # ends unless this execution saves one (one Redis call per task saved).
            req._request_dict[NO_CHECKPOINT] = True
        return True

    def _orphans_send(self, current: Ledger, entry: Entry, beat: Heartbeat) -> bool:
        """Write a first-hand delivery's entry without waiting; ``False`` if it could not be sent."""
        try:
            outbox.admit(current, entry, beat.lease_key)
        except redis.RedisError:
            return False  # written the slow way, whose client retries
        self._orphans_admitted(entry.token, beat)
        if entry.delivery.retries == 0 and entry.delivery.attempt == 0:
            # The caller's message, never delivered before: no execution of it can have saved one.
            req: Any = self
            req._request_dict[NO_CHECKPOINT] = True
        return True

    def _orphans_admitted(self, token: str, beat: Heartbeat) -> None:
        req: Any = self
        self._orphans_token = token
        # The execution holds only while this boot's lease does; the pool process reads it there.
        self._orphans_generation = req._request_dict[GENERATION] = beat.generation

    def _orphans_drop_stale(self, entry: Entry) -> None:
        req: Any = self
        logger.warning(
            "celery-orphans: dropped a stale copy of %s[%s] (recovery attempt %d, retries %d): "
            "the task was recovered or marked terminal after this copy was sent",
            req.name,
            req.id,
            entry.delivery.attempt,
            entry.delivery.retries,
        )
        self._orphans_drop()

    def _orphans_drop(self) -> None:
        req: Any = self
        task_ready(req)
        req._already_revoked = True
        req.acknowledge()

    def _orphans_forfeited(self) -> bool:
        """Whether this execution's boot gave it up; its entry then stays, for the sweep to recover it."""
        if self._orphans_generation is None:
            return False
        return self._orphans_forfeit or not fence.holds(self._orphans_generation)

    def _orphans_release(self) -> None:
        token, self._orphans_token = self._orphans_token, None
        if token is None or self._orphans_forfeited():
            return
        req: Any = self
        # Off the path from this acknowledgement to the next task (see outbox.py), unless no result row
        # will say the task ended: then its entry goes before anything else happens.
        outbox.release(self._orphans_ledger or ledger_for(), req.id, token, now=bool(req.task.ignore_result))

    def _orphans_hand_back(self) -> None:
        """The message goes back to the broker: mark the entry, so no sweep takes it for an orphan."""
        token, self._orphans_token = self._orphans_token, None
        if token is None:
            return
        req: Any = self
        try:
            outbox.settle()  # the entry was sent without waiting: it is in Redis once answered
            (self._orphans_ledger or ledger_for()).hand_back(req.id, token)
        except redis.RedisError as exc:
            logger.warning(
                "celery-orphans: cannot mark %s[%s] as handed back to the broker: %s", req.name, req.id, exc
            )

    def on_failure(self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False) -> None:
        if self._orphans_token is not None and self._orphans_forfeited():
            # Its boot gave it up (its pool process was killed for it, or it ended by ExecutionForfeit):
            # nothing is recorded over the execution that recovers it, and its entry stays.
            req: Any = self
            task_ready(req)
            req.acknowledge()
            return
        if self._orphans_token is not None and pool_loss.recover_lost(self, exc_info):
            return
        super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)  # type: ignore[misc]

    def cancel(self, *args: Any, **kwargs: Any) -> Any:
        # A cold shutdown cancels what runs; the broker gets the unacknowledged message back.
        req: Any = self
        if req.task.acks_late and not req.acknowledged:
            self._orphans_hand_back()
        return super().cancel(*args, **kwargs)  # type: ignore[misc]

    def acknowledge(self) -> None:
        super().acknowledge()  # type: ignore[misc]
        self._orphans_release()

    def reject(self, requeue: bool = False) -> None:
        super().reject(requeue)  # type: ignore[misc]
        if requeue:
            self._orphans_hand_back()
        else:
            self._orphans_release()


@functools.cache
def recoverable_request_class(base: type[Request]) -> type[Request]:
    """``base`` with the recoverable hooks mixed in (a project's own Request class keeps working)."""
    if issubclass(base, RecoverableRequestMixin):
        return base
    return type(f"Recoverable{base.__name__}", (RecoverableRequestMixin, base), {})
