"""A task claimed in Redis before it is acted on, and held until the action's transaction ends.

The claim fails if the task moved since it was observed (a worker picked it up, another sweep acted), so
concurrent sweeps never act twice. A recovery's claim is held until its transaction commits, and only
then is the old entry removed (settled); if the transaction rolls back, the hold is lifted so that the
next sweep finds the task at once rather than after the claim lapses.
"""

from __future__ import annotations

from celery_orphans import logs
from celery_orphans.conf import settings
from celery_orphans.entry import Entry
from celery_orphans.ledger import Ledger
from celery_orphans.observations import Candidate
from celery_orphans.scripts import ClaimMode

logger = logs.get(__name__)

# A terminal fence covers every copy of the task id, whatever its retry count.
ALL_RETRIES = 2**31 - 1


class Moved(Exception):
    """The task changed since it was observed; leave it to the next sweep."""


class Claims:
    """The claims one executor makes on ``ledger``, and the holds not yet settled."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        # Claims (recover, complete) not yet committed, by task id: their entry token.
        self._unsettled: dict[str, str] = {}

    def claim(
        self, task_id: str, candidate: Candidate, entry: Entry | None, mode: ClaimMode, *, keep: bool = False
    ) -> int:
        """Claim ``task_id`` for ``mode``; its recovery attempt. Raises ``Moved`` if it moved. A terminal
        claim with ``keep`` (at the cap) keeps the entry's message for an operator's lift."""
        claimed = self.ledger.claim(
            task_id,
            token=entry.token if entry else "",
            attempts=candidate.attempts,
            retries=entry.delivery.retries if entry and mode is ClaimMode.RECOVER else ALL_RETRIES,
            ttl=settings.ATTEMPTS_WINDOW_SECONDS,
            mode=mode,
            keep=keep,
        )
        if claimed is None:
            raise Moved
        return claimed

    def hold(self, task_id: str, token: str) -> None:
        """Keep the claim of ``task_id`` until ``settle`` (committed) or ``lift`` (rolled back)."""
        self._unsettled[task_id] = token

    def settle(self, task_id: str, token: str) -> None:
        self._unsettled.pop(task_id, None)
        # Harmless if it fails: the fence says the entry was sent again, so the next sweep only removes it.
        with logs.redis_fault_let_go(logger, "remove the old ledger entry of %s", task_id):
            self.ledger.release(task_id, token)

    def lift_unsettled(self) -> None:
        """Lift the holds of claims whose transaction rolled back (their release never ran).

        The row move and the audit event are gone with the transaction: the next sweep must be able
        to find and finish the task at once rather than after the claim lapses.
        """
        for task_id in list(self._unsettled):
            self.lift(task_id)

    def lift(self, task_id: str) -> None:
        token = self._unsettled.pop(task_id, None)
        if token is None:
            return
        # Harmless if it fails: the hold lapses after ledger.CLAIM_SECONDS and the next sweep judges it then.
        with logs.redis_fault_let_go(logger, "lift the hold on %s", task_id):
            self.ledger.unclaim(task_id, token)
