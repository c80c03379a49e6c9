"""Carrying out decisions: recover, mark terminal, forget.

Every action starts with one atomic claim in Redis that fails if the task moved since the sweep looked
(a worker picked it up, another sweep acted), so concurrent sweeps never act twice. The order of the
steps after it is chosen so that a crash between any two leaves the task detectable by the next sweep
and never runnable twice: the fence is raised before the message is sent, and the entry that finds the
task again is removed only after the message is out.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

import redis
from celery import Celery
from django.db import DatabaseError, transaction
from kombu.exceptions import KombuError, OperationalError

from celery_orphans import leases, logs, metrics
from celery_orphans.checkpoints import CheckpointStore, Saved
from celery_orphans.choices import Trigger
from celery_orphans.decision import Action, Decision, Evidence, Reason
from celery_orphans.entry import Entry
from celery_orphans.ledger import Ledger
from celery_orphans.observations import Candidate
from celery_orphans.recovery import audit, broker, rows
from celery_orphans.recovery.claims import Claims, Moved
from celery_orphans.recovery.deliveries import Deliveries
from celery_orphans.recovery.outcome import Outcome, describe, said
from celery_orphans.scripts import ClaimMode

logger = logs.get(__name__)

ACTS = frozenset({Action.RECOVER, Action.MARK_TERMINAL, Action.FORGET})
# The faults an action expects from the services it uses: it stops there, and the next sweep finds the
# task again. Anything else is a bug, and is raised.
_FAULTS = (redis.RedisError, DatabaseError, KombuError, OperationalError, OSError, broker.UnsafeMessage)


@dataclasses.dataclass(frozen=True)
class Step:
    """What one step did: the decision as carried out (a recovery's attempt set), and what follows it."""

    decision: Decision
    recorded: bool = True  # it wrote its audit row, so its signals are sent once that commits
    counted: bool = True  # the metrics count it (a recovery whose bookkeeping is finished was counted)
    checkpoint: Saved | None = None  # the task's last checkpoint, named in the audit row
    lost: Entry | None = None  # the lost execution's entry, whose last heartbeat the metrics measure from


StepFunction = Callable[[Decision, Candidate, Entry | None, str], Step]


def _level(decision: Decision, *, said: bool = False) -> int:
    """A recovery or a terminal mark is what an operator watches for: WARNING, unless it was said
    already (a shadow sweep finding the same orphan again). Forgetting a finished task is housekeeping."""
    return logging.DEBUG if said or decision.action is Action.FORGET else logging.WARNING


class Executor:
    def __init__(self, app: Celery, ledger: Ledger, trigger: Trigger, now: datetime, user: str = "") -> None:
        self.app = app
        self.ledger = ledger
        self.trigger = trigger
        self.user = user
        self.now = now
        self._checkpoints = CheckpointStore(ledger.client, ledger.keys)
        self.claims = Claims(ledger)
        self.deliveries = Deliveries(app)
        self.shadowed = 0  # shadow mode: the tasks whose "would have" was recorded for the first time
        self.reported = 0  # the records that cannot be trusted, reported for the first time

    def carry_out(self, outcome: Outcome, candidate: Candidate, entry: Entry | None) -> Outcome:
        """Carry ``outcome``'s decision out in one transaction; the outcome says whether it was done."""
        decision = outcome.decision
        step, done = self._step_for(decision), None
        try:
            with transaction.atomic():
                done = step(decision, candidate, entry, outcome.worker)
                if done.recorded:
                    audit.record(done.decision, checkpoint=done.checkpoint, **self._recorded_by(outcome))
        except Moved:
            self.claims.lift(decision.task_id)
            logger.info(
                "%s[%s] changed while the sweep looked at it; left for the next sweep",
                outcome.task_name,
                decision.task_id,
            )
            return outcome
        except _FAULTS as exc:
            self.claims.lift(decision.task_id)
            verb = decision.action.value.replace("_", " ")
            logger.error("could not %s %s[%s]: %s", verb, outcome.task_name, decision.task_id, exc)
            audit.record_failure(
                decision, f"could not {verb}: {type(exc).__name__}", **self._recorded_by(outcome)
            )
            decision = done.decision if done else decision  # a recovery's attempt, if it got that far
            error = said(exc)
            return dataclasses.replace(outcome, decision=decision, error=error)
        carried_out = dataclasses.replace(outcome, decision=done.decision, done=True)
        logger.log(_level(decision), "%s", describe(carried_out))
        if done.counted:
            self._count(carried_out, done.lost)
        if done.recorded:  # announced when the record is committed, once
            audit.announce(carried_out, self.trigger)
        return carried_out

    def _step_for(self, d: Decision) -> StepFunction:
        if d.reason is Reason.ALREADY_SENT:
            return self._finish_recording
        if d.action is Action.RECOVER and d.evidence is Evidence.BROKER_REDELIVERED:
            return self._record_redelivery
        steps: dict[Action, StepFunction] = {
            Action.RECOVER: self._recover,
            Action.MARK_TERMINAL: self._mark_terminal,
            Action.FORGET: self._forget,
        }
        return steps[d.action]

    def shadow(self, outcome: Outcome) -> Outcome:
        """Shadow mode: audit what would be done (once per task), change nothing else. It is said once
        per task too, when first recorded: each sweep finds the same orphan again."""
        try:
            recorded = audit.record_once(outcome.decision, shadow=True, **self._recorded_by(outcome))
        except DatabaseError as exc:
            return dataclasses.replace(outcome, error=said(exc))
        if recorded is not None:
            self.shadowed += 1
        logger.log(
            _level(outcome.decision, said=recorded is None), "shadow mode: would have %s", describe(outcome)
        )
        return dataclasses.replace(outcome, done=True)

    def report(self, outcome: Outcome) -> None:
        """Audit, once per task, a record that cannot be trusted (forged, altered, unreadable): nothing is
        done with it, and a person must look."""
        try:
            recorded = audit.record_once(outcome.decision, **self._recorded_by(outcome))
        except DatabaseError as exc:
            logger.error("could not audit the report of %s: %s", outcome.decision.task_id, exc)
            return
        if recorded is not None:
            self.reported += 1

    def _recorded_by(self, outcome: Outcome) -> dict[str, Any]:
        """What an audit row of ``outcome`` names besides its decision: the task, worker and trigger."""
        return {
            "task_name": outcome.task_name,
            "worker": outcome.worker,
            "trigger": self.trigger,
            "user": self.user,
        }

    def _recover(self, d: Decision, candidate: Candidate, entry: Entry | None, worker: str) -> Step:
        assert entry is not None  # decide() recovers only with an entry
        # Read before the claim: once the message is sent, a failure here must not undo it.
        saved = self._checkpoints.last_saved(d.task_id)
        attempt = self.claims.claim(d.task_id, candidate, entry, ClaimMode.RECOVER)
        self.claims.hold(d.task_id, entry.token)
        d = dataclasses.replace(d, attempt=attempt)
        detail = f"orphaned on {entry.node}: {d.detail}; sent again"
        if not rows.mark_retry(d.task_id, detail) and rows.finished(d.task_id):
            raise Moved  # it ended after the sweep read its row: nothing to send again
        recovery = {
            "attempt": attempt,
            "recovered_at": self.now.isoformat(),
            "evidence": d.evidence.value,
            "worker": entry.node,
            "boot": entry.boot,
        }
        broker.publish(self.app, entry, recovery)
        # The message is out: failing the recovery now would roll back the record that it was sent,
        # which is what the next sweep reads instead of this mark.
        with logs.redis_fault_let_go(logger, "could not record that %s was sent again", d.task_id):
            self.ledger.mark_sent(d.task_id, entry.token)
        if entry.delivery.delivery_tag:
            self.deliveries.discard([entry.delivery.delivery_tag])
        # Only once the row's move to RETRY is committed: should this process die before that, the
        # entry lets the next sweep find the task again instead of judging it by a STARTED row alone.
        transaction.on_commit(lambda: self.claims.settle(d.task_id, entry.token))
        return Step(d, checkpoint=saved, lost=entry)

    def _record_redelivery(self, d: Decision, candidate: Candidate, entry: Entry | None, worker: str) -> Step:
        # The admit counted the broker's redelivery: only the record is left (the lost beat is unknown).
        return Step(d)

    def _finish_recording(self, d: Decision, candidate: Candidate, entry: Entry | None, worker: str) -> Step:
        """Finish a recovery an earlier sweep sent; its audit row is written now if it was lost."""
        assert entry is not None  # decide() says already sent only of an entry
        self.claims.claim(d.task_id, candidate, entry, ClaimMode.COMPLETE)
        self.claims.hold(d.task_id, entry.token)
        # The row's move and the audit row commit together: the audit row tells whether both were kept.
        lost = not audit.recovery_recorded(d.task_id, candidate.attempts, entry.recorded_at)
        if lost:
            rows.mark_retry(d.task_id, f"orphaned on {entry.node}: {d.detail}")
        transaction.on_commit(lambda: self.claims.settle(d.task_id, entry.token))
        return Step(d, recorded=lost, counted=False)  # the sweep that sent it counted it

    def _mark_terminal(self, d: Decision, candidate: Candidate, entry: Entry | None, worker: str) -> Step:
        # At the cap the message is kept (off every sweep's sight) for an operator who may lift the cap.
        keep = d.reason is Reason.LIMIT_REACHED
        self.claims.claim(d.task_id, candidate, entry, ClaimMode.TERMINAL, keep=keep)
        detail = f"orphaned on worker {worker}: {d.detail}"
        limit_reached = d.reason is Reason.LIMIT_REACHED
        if not rows.mark_failure(d.task_id, detail, limit_reached=limit_reached) and rows.finished(d.task_id):
            raise Moved
        self.deliveries.discard(self.deliveries.dead(d.task_id, entry))
        # After commit, so no worker reads a half-written state when it handles the revoke (see close()).
        transaction.on_commit(lambda: self.deliveries.revoke_later(d.task_id))
        # The task never runs again: nothing will resume from its checkpoint. Harmless if it fails: the
        # checkpoint expires after CHECKPOINT_TTL_SECONDS.
        transaction.on_commit(lambda: self._forget_checkpoint(d.task_id))
        return Step(d, lost=entry)

    def _forget(self, d: Decision, candidate: Candidate, entry: Entry | None, worker: str) -> Step:
        self.claims.claim(d.task_id, candidate, entry, ClaimMode.FORGET)
        return Step(d)

    def _count(self, outcome: Outcome, lost: Entry | None) -> None:
        d = outcome.decision
        if d.action is Action.MARK_TERMINAL:
            metrics.marked_terminal(outcome.task_name, d.reason.value)
        elif d.action is Action.RECOVER:
            since = None if lost is None else self._since_last_heartbeat(lost)
            metrics.recovered(outcome.task_name, d.evidence.value, since)

    def _since_last_heartbeat(self, entry: Entry) -> float | None:
        # The action is done by now: a metric that cannot be measured must not undo it.
        heartbeats: dict[tuple[str, str], float] = {}
        with logs.redis_fault_let_go(logger, "could not read the last heartbeat of %s", entry.node):
            heartbeats = leases.last_heartbeats([(entry.node, entry.boot)], self.ledger.client)
        last = heartbeats.get((entry.node, entry.boot))
        return None if last is None else time.time() - last

    def _forget_checkpoint(self, task_id: str) -> None:
        with logs.redis_fault_let_go(logger, "could not remove the checkpoint of %s", task_id):
            self._checkpoints.forget(task_id)

    def close(self) -> None:
        """Revoke the tasks marked terminal, in one broadcast, and close the executor's broker connection.

        Called once the sweep's transaction has ended: only marks it committed are revoked.
        """
        self.deliveries.close()
