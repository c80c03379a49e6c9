"""The admission of a delivery: the first half of the Request hook (``request.py`` is the other).

It runs in the worker's main process, where the delivered message is at hand. Celery calls
``Request.revoked()`` just before it hands a task to the pool; that is the last point at which a message
can be dropped without running it, so the ledger write, the fence check and the duplicate check happen
there. A first-hand delivery needs neither check, and its write goes out without waiting (``outbox.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import redis
from celery.worker import state as worker_state
from celery.worker.request import Request
from celery.worker.state import task_ready

from celery_orphans import logs
from celery_orphans.decision import Evidence
from celery_orphans.entry import HEADER, Entry
from celery_orphans.ledger import Ledger, Terms
from celery_orphans.worker import admission_line, clock, lifecycle, redelivery
from celery_orphans.worker.admission_line import admit
from celery_orphans.worker.bounded import NotSent
from celery_orphans.worker.checkpoint import NO_CHECKPOINT
from celery_orphans.worker.forfeit import GENERATION
from celery_orphans.worker.heartbeat import Heartbeat
from celery_orphans.worker.hold import give_back_marked, holds, later
from celery_orphans.worker.outbox import outbox
from celery_orphans.worker.takeover import boot_ledger, entry_for

logger = logs.get(__name__)

# The mixin is typed as the Request it is mixed into (recoverable_request_class); it derives from object.
if TYPE_CHECKING:
    _Request = Request
else:
    _Request = object


class AdmittedRequest(_Request):
    """Records the delivery before it runs, and drops stale and duplicate copies."""

    if TYPE_CHECKING:
        _already_revoked: bool  # Celery's: revoked() answers True from then on
        _connection_errors: tuple[type[BaseException], ...]  # Celery's: the broker's, for reject_log_error

    _orphans_checked: bool = False
    _orphans_token: str | None = None
    _orphans_ledger: Ledger | None = None
    _orphans_generation: int | None = None  # of the worker boot that admitted it (forfeit.py)
    # Whether Redis recorded its entry: None while a write sent without waiting is not answered yet.
    _orphans_recorded: bool | None = None

    def revoked(self) -> bool:
        if self.id in worker_state.revoked and self._orphans_sent_after_a_lift():
            # The copy a lifted cap's recovery sent, on a worker that kept the revoke its terminal mark
            # broadcast: it was down when the lift took that back (its --statedb restored it at boot, or a
            # peer's did through mingle). The admission below still drops any copy but that one.
            worker_state.revoked.discard(self.id)
        if super().revoked():
            return True
        if self._orphans_checked:
            return False
        self._orphans_checked = True
        return not self._orphans_admit()

    def _orphans_sent_after_a_lift(self) -> bool:
        heartbeat = lifecycle.current()
        if heartbeat is None or not heartbeat.leased or not self.task.acks_late:
            return False  # no admission would check the fence: the revoke stands
        meta = (self.message.headers or {}).get(HEADER)
        return isinstance(meta, dict) and meta.get("evidence") == Evidence.CAP_LIFTED.value

    def _orphans_admit(self) -> bool:
        heartbeat = lifecycle.current()
        if heartbeat is None or not self.task.acks_late:
            return True  # without acks_late the broker has already forgotten the message
        if redelivery.single_flight() and self.delivery_info.get("redelivered") and redelivery.finished(self):
            self._orphans_drop()  # its result is stored: its acknowledgement was lost, not its execution
            return False
        if not heartbeat.leased:
            # Without a lease (its ledger could not be reached when the worker started, or the boot was
            # given up and the next lease is not taken yet) nothing could prove this worker dead, and an
            # entry would name a boot no sweep can see alive: the delivery cannot be recorded. It goes
            # back to the broker unrun while the trouble is young; past LEDGER_HOLD_SECONDS it fails
            # open: the task runs unrecorded, and no generation that does not hold is stamped on it, so
            # nothing forfeits it later; but a copy a recovery has overtaken is still dropped, if Redis
            # answers.
            if holds.holding(heartbeat):
                return self._orphans_hold("its worker holds no lease", worker_wide=True)
            entry = entry_for(self, heartbeat, "")
            return not self._orphans_overtaken(entry, boot_ledger(heartbeat), heartbeat.time_left())
        # The generation whose boot the entry names is the one stamped on the execution, whatever the
        # generation is by the time the write is answered.
        generation = heartbeat.generation
        # A message this boot gave back unmarked (Redis refused the mark) after its write got no answer is
        # written with that write's token: an entry the write left is its own (``ADMIT``), not a duplicate.
        token = holds.token_for(self.id, heartbeat.boot) or heartbeat.token()
        entry = entry_for(self, heartbeat, token)
        if heartbeat.generation != generation:  # given up meanwhile: the entry names a boot with no lease
            return self._orphans_admit()
        lease = heartbeat.keys.lease(heartbeat.node, entry.boot)
        # The ledger lives where this boot's lease does (its key prefix was read when the lease began),
        # found once per boot.
        self._orphans_ledger = current = boot_ledger(heartbeat)
        # Without waiting only while the lease is being renewed: a ledger that stopped answering or
        # refuses writes is noticed at the next renewal, and from then on no delivery is stamped with a
        # generation before its entry is known to be recorded.
        if redelivery.first_hand(self) and heartbeat.answered and holds.refused_since is None:
            sent = self._orphans_send(current, entry, lease, heartbeat, generation)
            if sent is not None:
                return sent
        # Finished tasks' entries, removed by the same call; none if the answers owed before them are late.
        releases = outbox.take(current, heartbeat.time_left())
        cap, ttl = redelivery.limits(self)
        try:
            # Bounded by the boot's lease: a write still on its way when the lease may have lapsed in Redis
            # is refused there (the boot is gone), so waiting longer could learn nothing; an answer that
            # comes after the validity ended drops the delivery, which is recovered from its entry.
            admission = admit(
                current,
                entry,
                releases,
                Terms(lease=lease, cap=cap, ttl=ttl, single_flight=redelivery.single_flight()),
                _bound(heartbeat),
            )
        except redis.RedisError as exc:
            outbox.give_back(current, releases)
            if not isinstance(exc, redis.ResponseError):
                if redelivery.first_hand(self) and not holds.holding(heartbeat):
                    # Past the bounded hold a first delivery runs unprotected; none can have been overtaken.
                    logger.warning("cannot record %s[%s] in the ledger: %s", self.name, self.id, exc)
                    return True
                # No answer in time: the write may yet land, naming this live boot, and a sweep that
                # reaches Redis may recover an earlier delivery's entry meanwhile. Run here, the task
                # could run twice: the message goes back unrun. Once sent, Redis may have written its
                # entry: marked handed back before the message goes, its token void should the write
                # land only later; so no delivery, here or elsewhere, is a duplicate of a live execution.
                why = f"its ledger write got no answer in time ({exc})"
                if isinstance(exc, NotSent):
                    return self._orphans_hold(why)
                return self._orphans_hold(why, unanswered=(current, token))
            # Refused (OOM, READONLY, MISCONF): nothing was written. Held while the trouble is young;
            # then fail open: the task runs, it just cannot be recovered if this worker dies, and no sweep
            # can claim it from a refusing Redis either.
            holds.refused()
            if holds.holding(heartbeat):
                return self._orphans_hold(f"its ledger refused the write ({exc})", worker_wide=True)
            logger.warning("cannot record %s[%s] in the ledger: %s", self.name, self.id, exc)
            return not self._orphans_overtaken(entry, current, heartbeat.time_left())
        if admission.duplicate:
            redelivery.drop_duplicate(self, admission.previous)
            self._orphans_drop()
            return False
        if admission.given_back:  # its token was that of a delivery given back before: nothing written
            return self._orphans_hold("its write carried the token of a delivery given back before")
        if admission.writer_gone and not redelivery.first_hand(self):
            # An earlier delivery's entry, if any, names a boot a sweep may judge gone and recover the task
            # from while this one would run unprotected (a worker whose first lease lapsed before it was
            # ready, as on a loaded machine): two runs. The broker keeps the message until it can be
            # recorded, or a recovery overtakes it.
            return self._orphans_hold("its boot's lease had lapsed when the write reached Redis")
        if admission.writer_gone:
            # Its write reached Redis after the boot's lease had lapsed (held up on the way) and was not
            # written: no entry names a boot that gave the task up. Held as a refused write is, then it
            # runs unprotected, as fail open does (the script found it not stale).
            if holds.holding(heartbeat):
                why = "its boot's lease had lapsed when the write reached Redis"
                return self._orphans_hold(why, worker_wide=True)
            logger.warning(
                "cannot record %s[%s] in the ledger: its boot's lease lapsed before the write reached "
                "Redis; it runs unprotected",
                self.name,
                self.id,
            )
            return True
        if not admission.admitted:
            self._orphans_drop_stale(entry)
            return False
        if heartbeat.generation != generation:
            return self._orphans_given_up_meanwhile()
        self._orphans_recorded = True
        self._orphans_admitted(token, generation)
        if (admission.redelivered or admission.limit_reached) and redelivery.handle_counted(self, admission):
            self._orphans_drop()  # marked terminal: recovered as often as its cap allows
            return False
        if not admission.checkpoint:
            # Goes to the pool process with the request: no checkpoint to remove when the task
            # ends unless this execution saves one (one Redis call per task saved).
            self.request_dict[NO_CHECKPOINT] = True
        return True

    def _orphans_overtaken(self, entry: Entry, current: Ledger, seconds: float) -> bool:
        """A delivery that runs unrecorded: whether a recovery overtook its copy (then it is dropped). A
        first delivery cannot have been; a fence Redis does not answer about within ``seconds`` (what is
        left of the boot's validity, a heartbeat while none holds) is taken as not moved."""
        if redelivery.first_hand(self):
            return False
        try:
            stale = admission_line.stale(current, entry, seconds)
        except redis.RedisError:
            return False
        if stale:
            self._orphans_drop_stale(entry)
        return stale

    def _orphans_given_up_meanwhile(self) -> bool:
        """The entry was recorded, but the boot it names was given up while the write was on its way (the
        main loop was held up by a ledger link gone dark): that boot's executions are forfeit, and the
        sweep recovers the task from its entry, once. Run here too, it would run twice: it is dropped."""
        logger.warning(
            "dropped %s[%s]: its ledger entry was recorded after its boot was given up, and the task is "
            "recovered from it",
            self.name,
            self.id,
        )
        self._orphans_drop()
        return False

    def _orphans_send(
        self, current: Ledger, entry: Entry, lease: str, heartbeat: Heartbeat, generation: int
    ) -> bool | None:
        """Write a first-hand delivery's entry without waiting: whether it runs, or ``None`` if the entry
        could not be sent (it is written the slow way, waiting for its verdict)."""
        try:
            # A connection made for it is bounded as a waiting admission is (below): the write that could
            # not be sent in time is made the slow way, with what is left of the same bound.
            outbox.admit(current, entry, lease, self._orphans_answered, _bound(heartbeat))
        except redis.RedisError:
            return None
        if heartbeat.generation != generation:
            # The boot was given up while the write was being sent (the outbox's connection was being
            # made over a link gone dark): whether an entry names that boot decides.
            outbox.settle()
            if self._orphans_recorded:
                return self._orphans_given_up_meanwhile()
            # Nothing recorded (refused, or its boot's lease had lapsed): held as any delivery that cannot
            # be recorded, then it runs unprotected.
            if holds.holding(heartbeat):
                return self._orphans_hold("its boot was given up as its entry was sent", worker_wide=True)
            return True
        self._orphans_admitted(entry.token, generation)
        if entry.delivery.retries == 0 and entry.delivery.attempt == 0:
            # The caller's message, never delivered before: no execution of it can have saved one.
            self.request_dict[NO_CHECKPOINT] = True
        return True

    def _orphans_answered(self, recorded: bool) -> None:
        self._orphans_recorded = recorded
        if not recorded:
            holds.refused()  # the next deliveries wait for their verdict, and are held while it is a refusal

    def _orphans_admitted(self, token: str, generation: int) -> None:
        holds.recorded(self.id, answered=bool(self._orphans_recorded))
        self._orphans_token = token
        # The execution holds only while this boot's lease does; the pool process reads it there.
        self._orphans_generation = self.request_dict[GENERATION] = generation

    def _orphans_drop_stale(self, entry: Entry) -> None:
        logger.warning(
            "dropped a stale copy of %s[%s] (recovery attempt %d, retries %d): "
            "the task was recovered or marked terminal after this copy was sent",
            self.name,
            self.id,
            entry.delivery.attempt,
            entry.delivery.retries,
        )
        self._orphans_drop()

    def _orphans_requeue(self) -> None:
        """``reject(requeue=True)``, sent at once: Celery's goes through the loop's ``call_soon``, which,
        called from a timer of the loop (a hand-back that waited), waits for the loop's next poll."""
        if not self.acknowledged:
            self.message.reject_log_error(logger, self._connection_errors, requeue=True)
            self.acknowledged = True
            self.send_event("task-rejected", requeue=True)

    def _orphans_drop(self) -> None:
        task_ready(self)
        self._already_revoked = True
        self.acknowledge()

    def _orphans_hold(
        self, why: str, *, worker_wide: bool = False, unanswered: tuple[Ledger, str] | None = None
    ) -> bool:
        """Give a message back to the broker, unrun, when its admission was not recorded (``hold.py``). It
        is delivered again, and admitted (or dropped as overtaken) once the ledger records it.
        ``worker_wide``: the trouble is the worker's, not this message's. ``unanswered``: the ledger and
        token of a write that got no answer, whose entry is marked handed back first."""
        wait = holds.wait_before(self.name, self.id, why, worker_wide=worker_wide)
        task_ready(self)
        self._already_revoked = True
        heartbeat = lifecycle.current()
        if unanswered is not None and heartbeat is not None:
            ledger, token = unanswered
            give_back_marked(ledger, self.id, token, heartbeat, wait, self._orphans_requeue)
            return False
        if not wait or not later(wait, self._orphans_requeue):
            self._orphans_requeue()
        return False


def _bound(heartbeat: Heartbeat) -> float:
    """What an admission's ledger call may take: until the boot's lease may lapse in Redis."""
    return heartbeat.valid_until + heartbeat.margin - clock.now()
