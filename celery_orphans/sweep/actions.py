"""Carrying out decisions: recover, mark terminal, forget.

Every action starts with one atomic claim in Redis that fails if the task moved since the sweep looked
(a worker picked it up, another sweep acted), so concurrent sweeps never act twice. The order of the
steps after it is chosen so that a crash between any two leaves the task detectable by the next sweep
and never runnable twice: the fence is raised before the message is sent, and the entry that finds the
task again is removed only after the message is out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from datetime import datetime
from typing import Any

import redis
from celery import Celery
from django.db import DatabaseError, transaction
from kombu import Connection
from kombu.exceptions import KombuError, OperationalError

from celery_orphans import leases, metrics
from celery_orphans.checkpoints import CheckpointStore
from celery_orphans.choices import Trigger
from celery_orphans.conf import settings
from celery_orphans.entry import Entry
from celery_orphans.ledger import Ledger
from celery_orphans.reconcile import Action, Candidate, Decision, Evidence, Reason
from celery_orphans.sweep import audit, broker, rows
from celery_orphans.sweep.values import Outcome

logger = logging.getLogger(__name__)

ACTS = frozenset({Action.RECOVER, Action.MARK_TERMINAL, Action.FORGET})
# A terminal fence covers every copy of the task id, whatever its retry count.
ALL_RETRIES = 2**31 - 1
_FAILURES = (redis.RedisError, DatabaseError, KombuError, OperationalError, OSError, ValueError)


class Moved(Exception):
    """The task changed since it was observed; leave it to the next sweep."""


class Executor:
    def __init__(self, app: Celery, ledger: Ledger, trigger: Trigger, now: datetime, user: str = "") -> None:
        self.app = app
        self.ledger = ledger
        self.trigger = trigger
        self.user = user
        self.now = now
        self._checkpoints = CheckpointStore(ledger.client, ledger.keys)
        # Claims (recover, complete) whose transaction has not committed yet, by task id: their entry token.
        self._unsettled: dict[str, str] = {}
        # The broker connection of the executor's own, opened at the first dead delivery to remove (one per
        # action cost more than the rest of the action), and the unacked tags, read at the first task
        # without one.
        self._broker: Connection | None = None
        self._unacked: dict[str, list[str]] | None = None
        self._revoked: list[str] = []  # marked terminal and committed: revoked together once done

    def carry_out(self, outcome: Outcome, candidate: Candidate, entry: Entry | None) -> Outcome:
        decision = outcome.decision
        saved = None
        completing = decision.reason is Reason.ALREADY_SENT
        redelivered = decision.action is Action.RECOVER and decision.evidence is Evidence.BROKER_REDELIVERED
        first_record = True
        try:
            with transaction.atomic():
                if completing:
                    assert entry is not None  # decide() says already sent only of an entry
                    first_record = self._complete(decision, candidate, entry)
                elif redelivered:
                    pass  # the broker sent it again and the admit counted it: only the record is left
                elif decision.action is Action.RECOVER:
                    assert entry is not None  # decide() recovers only with an entry
                    # Read before the claim: once the message is sent, a failure here must not undo it.
                    saved = self._checkpoints.last_saved(decision.task_id)
                    decision = self._recover(decision, candidate, entry)
                elif decision.action is Action.MARK_TERMINAL:
                    self._mark_terminal(decision, candidate, entry, outcome.worker)
                else:
                    self._claim(decision.task_id, candidate, entry, "forget")
                if first_record:
                    audit.record(decision, checkpoint=saved, **self._recorded_by(outcome))
        except Moved:
            self._lift(decision.task_id)
            logger.info(
                "celery-orphans: %s[%s] changed while the sweep looked at it; left for the next sweep",
                outcome.task_name,
                decision.task_id,
            )
            return outcome
        except _FAILURES as exc:
            self._lift(decision.task_id)
            logger.error(
                "celery-orphans: could not %s %s[%s]: %s",
                decision.action.value.replace("_", " "),
                outcome.task_name,
                decision.task_id,
                exc,
            )
            return dataclasses.replace(outcome, decision=decision, error=f"{type(exc).__name__}: {exc}")
        done = dataclasses.replace(outcome, decision=decision, done=True)
        logger.info("celery-orphans: %s", describe(done))
        if not completing:  # the sweep that sent it counted it
            # A redelivery's entry is the new execution's: the lost one's last beat is not at hand.
            self._count(done, None if redelivered else entry)
        if first_record:  # announced when the recovery's record is committed, once
            audit.announce(done, self.trigger)
        return done

    def _count(self, outcome: Outcome, entry: Entry | None) -> None:
        d = outcome.decision
        if d.action is Action.MARK_TERMINAL:
            metrics.marked_terminal(outcome.task_name, d.reason.value)
        elif d.action is Action.RECOVER:
            since = None if entry is None else self._since_last_beat(entry)
            metrics.recovered(outcome.task_name, d.evidence.value, since)

    def _since_last_beat(self, entry: Entry) -> float | None:
        # The action is done by now: a metric that cannot be measured must not undo it.
        try:
            beats = leases.last_beats([(entry.node, entry.boot)], self.ledger.client)
        except redis.RedisError as exc:
            logger.warning("celery-orphans: could not read the last heartbeat of %s: %s", entry.node, exc)
            return None
        last = beats.get((entry.node, entry.boot))
        return None if last is None else time.time() - last

    def shadow(self, outcome: Outcome) -> Outcome:
        """Shadow mode: audit what would be done (once per task), change nothing else."""
        decision = outcome.decision
        logger.info("celery-orphans: shadow mode: would have %s", describe(outcome))
        try:
            audit.record_once(decision, shadow=True, **self._recorded_by(outcome))
        except DatabaseError as exc:
            return dataclasses.replace(outcome, error=f"{type(exc).__name__}: {exc}")
        return dataclasses.replace(outcome, done=True)

    def _recorded_by(self, outcome: Outcome) -> dict[str, Any]:
        """What an audit row of ``outcome`` names besides its decision: the task, worker and trigger."""
        return {
            "task_name": outcome.task_name,
            "worker": outcome.worker,
            "trigger": self.trigger,
            "user": self.user,
        }

    def _claim(self, task_id: str, candidate: Candidate, entry: Entry | None, mode: str) -> int:
        claimed = self.ledger.claim(
            task_id,
            token=entry.token if entry else "",
            attempts=candidate.attempts,
            retries=entry.delivery.retries if entry and mode == "recover" else ALL_RETRIES,
            ttl=settings.ATTEMPTS_WINDOW_SECONDS,
            mode=mode,
        )
        if claimed is None:
            raise Moved
        return claimed

    def _recover(self, decision: Decision, candidate: Candidate, entry: Entry) -> Decision:
        attempt = self._claim(decision.task_id, candidate, entry, "recover")
        self._unsettled[decision.task_id] = entry.token
        decision = dataclasses.replace(decision, attempt=attempt)
        detail = f"orphaned on {entry.node}: {decision.detail}; sent again"
        if not rows.mark_retry(decision.task_id, detail) and rows.finished(decision.task_id):
            raise Moved  # it ended after the sweep read its row: nothing to send again
        broker.publish(
            self.app,
            entry,
            {
                "attempt": attempt,
                "recovered_at": self.now.isoformat(),
                "evidence": decision.evidence.value,
                "worker": entry.node,
                "boot": entry.boot,
            },
        )
        self._mark_sent_quietly(decision.task_id, entry.token)
        if entry.delivery.delivery_tag:
            broker.discard_unacked(self._transport(), [entry.delivery.delivery_tag])
        # Only once the row's move to RETRY is committed: should this process die before that, the
        # entry lets the next sweep find the task again instead of judging it by a STARTED row alone.
        transaction.on_commit(lambda: self._settle(decision.task_id, entry.token))
        return decision

    def _mark_sent_quietly(self, task_id: str, token: str) -> None:
        try:
            self.ledger.mark_sent(task_id, token)
        except redis.RedisError as exc:
            # The message is out: failing the recovery now would roll back the record that it was sent,
            # which is what the next sweep reads instead of this mark.
            logger.warning("celery-orphans: could not record that %s was sent again: %s", task_id, exc)

    def _complete(self, decision: Decision, candidate: Candidate, entry: Entry) -> bool:
        """Finish a recovery an earlier sweep sent; ``True`` when its record was lost and is written now."""
        self._claim(decision.task_id, candidate, entry, "complete")
        self._unsettled[decision.task_id] = entry.token
        # The row's move and the audit row commit together: the audit row tells whether both were kept.
        lost = not audit.recovery_recorded(decision.task_id, candidate.attempts, entry.recorded_at)
        if lost:
            rows.mark_retry(decision.task_id, f"orphaned on {entry.node}: {decision.detail}")
        transaction.on_commit(lambda: self._settle(decision.task_id, entry.token))
        return lost

    def _settle(self, task_id: str, token: str) -> None:
        self._unsettled.pop(task_id, None)
        self._release_quietly(task_id, token)

    def lift_unsettled(self) -> None:
        """Lift the holds of claims whose transaction rolled back (their release never ran).

        The row move and the audit event are gone with the transaction: the next sweep must be able
        to find and finish the task at once rather than after the claim lapses.
        """
        for task_id in list(self._unsettled):
            self._lift(task_id)

    def _lift(self, task_id: str) -> None:
        token = self._unsettled.pop(task_id, None)
        if token is None:
            return
        try:
            self.ledger.unclaim(task_id, token)
        except redis.RedisError as exc:
            # Harmless: the hold lapses after ledger.CLAIM_SECONDS and the next sweep judges it then.
            logger.warning("celery-orphans: could not lift the hold on %s: %s", task_id, exc)

    def _release_quietly(self, task_id: str, token: str) -> None:
        try:
            self.ledger.release(task_id, token)
        except redis.RedisError as exc:
            # Harmless: the fence says the entry was sent again, so the next sweep only removes it.
            logger.warning("celery-orphans: could not remove the old ledger entry of %s: %s", task_id, exc)

    def _mark_terminal(
        self, decision: Decision, candidate: Candidate, entry: Entry | None, worker: str
    ) -> None:
        self._claim(decision.task_id, candidate, entry, "terminal")
        detail = f"orphaned on worker {worker}: {decision.detail}"
        limit_reached = decision.reason is Reason.LIMIT_REACHED
        if not rows.mark_failure(decision.task_id, detail, limit_reached=limit_reached) and rows.finished(
            decision.task_id
        ):
            raise Moved
        broker.discard_unacked(self._transport(), self._dead_deliveries(decision.task_id, entry))
        # After commit, so no worker reads a half-written state when it handles the revoke (see close()).
        transaction.on_commit(lambda: self._revoked.append(decision.task_id))
        # The task never runs again: nothing will resume from its checkpoint.
        transaction.on_commit(lambda: self._forget_checkpoint_quietly(decision.task_id))

    def _dead_deliveries(self, task_id: str, entry: Entry | None) -> list[str]:
        """The tags of the task's deliveries the transport still holds as unacknowledged."""
        if entry is not None and entry.delivery.delivery_tag:
            return [entry.delivery.delivery_tag]
        if self._unacked is None:
            # A task without an entry was delivered before the sweep began: one scan finds every such tag.
            self._unacked = broker.unacked_tags(self._transport())
        return self._unacked.get(task_id, [])

    def _transport(self) -> Connection:
        if self._broker is None:
            self._broker = self.app.connection_for_write()
        return self._broker

    def close(self) -> None:
        """Revoke the tasks marked terminal, in one broadcast, and close the executor's broker connection.

        Called once the sweep's transaction has ended: only marks it committed are revoked.
        """
        revoked, self._revoked = self._revoked, []
        if revoked:
            _revoke_quietly(self.app, revoked)
        conn, self._broker = self._broker, None
        if conn is not None:
            # A broken connection must not hide the sweep's outcome, or its own error.
            with contextlib.suppress(*conn.connection_errors, *conn.channel_errors, OSError):
                conn.release()

    def _forget_checkpoint_quietly(self, task_id: str) -> None:
        try:
            self._checkpoints.forget(task_id)
        except redis.RedisError as exc:
            # Harmless: it expires after CHECKPOINT_TTL_SECONDS.
            logger.warning("celery-orphans: could not remove the checkpoint of %s: %s", task_id, exc)


def _revoke_quietly(app: Celery, task_ids: list[str]) -> None:
    try:
        broker.revoke(app, task_ids)
    except (KombuError, OperationalError, OSError) as exc:
        # Their fences are terminal: a copy that reaches a worker is dropped there all the same.
        logger.warning(
            "celery-orphans: could not broadcast a revoke of %d tasks (%s): %s",
            len(task_ids),
            ", ".join(task_ids[:5]),
            exc,
        )


def describe(outcome: Outcome) -> str:
    """One log line's worth: what was done to which task, from which worker, and why."""
    d = outcome.decision
    if d.reason is Reason.ALREADY_SENT:
        return (
            f"finished recording recovery {d.attempt} of {outcome.task_name}[{d.task_id}] from worker "
            f"{outcome.worker or '?'}: {d.reason.value}"
        )
    attempt = f", attempt {d.attempt}" if d.action is Action.RECOVER else ""
    return (
        f"{_PAST[d.action]} {outcome.task_name}[{d.task_id}] from worker {outcome.worker or '?'}: "
        f"{d.reason.value} ({d.evidence.value or 'no evidence needed'}{attempt})"
    )


_PAST = {
    Action.RECOVER: "recovered",
    Action.MARK_TERMINAL: "marked terminal",
    Action.FORGET: "forgot finished",
}
