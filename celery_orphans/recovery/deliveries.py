"""The broker's side of one executor's actions: the dead deliveries it removes, over a connection of its
own, and the tasks it marked terminal, revoked together once their marks are committed."""

from __future__ import annotations

import contextlib

from celery import Celery
from kombu import Connection
from kombu.exceptions import KombuError, OperationalError

from celery_orphans import logs
from celery_orphans.entry import Entry
from celery_orphans.recovery import broker

logger = logs.get(__name__)


class Deliveries:
    """What one executor does at the broker, on a connection opened at the first dead delivery to remove
    (one per action cost more than the rest of the action)."""

    def __init__(self, app: Celery) -> None:
        self.app = app
        self._broker: Connection | None = None
        # The unacked tags, read at the first task without a tag of its own.
        self._unacked: dict[str, list[str]] | None = None
        self._revoked: list[str] = []  # marked terminal and committed: revoked together once done

    def discard(self, tags: list[str]) -> None:
        """Remove the deliveries ``tags`` the transport holds unacknowledged."""
        broker.discard_unacked(self._transport(), tags)

    def dead(self, task_id: str, entry: Entry | None) -> list[str]:
        """The tags of the task's deliveries the transport still holds as unacknowledged."""
        if entry is not None and entry.delivery.delivery_tag:
            return [entry.delivery.delivery_tag]
        if self._unacked is None:
            # A task without an entry was delivered before the sweep began: one scan finds every such tag.
            self._unacked = broker.unacked_tags(self._transport())
        return self._unacked.get(task_id, [])

    def revoke_later(self, task_id: str) -> None:
        """Revoke ``task_id`` at ``close()``, with the others marked terminal (its mark is committed)."""
        self._revoked.append(task_id)

    def _transport(self) -> Connection:
        if self._broker is None:
            self._broker = self.app.connection_for_write()
        return self._broker

    def close(self) -> None:
        """Revoke the tasks marked terminal, in one broadcast, and close the connection."""
        revoked, self._revoked = self._revoked, []
        if revoked:
            _revoke_quietly(self.app, revoked)
        conn, self._broker = self._broker, None
        if conn is not None:
            # A broken connection must not hide the sweep's outcome, or its own error.
            with contextlib.suppress(*conn.connection_errors, *conn.channel_errors, OSError):
                conn.release()


def _revoke_quietly(app: Celery, task_ids: list[str]) -> None:
    try:
        broker.revoke(app, task_ids)
    except (KombuError, OperationalError, OSError) as exc:
        # Their fences are terminal: a copy that reaches a worker is dropped there all the same.
        logger.warning(
            "could not broadcast a revoke of %d tasks (%s): %s", len(task_ids), ", ".join(task_ids[:5]), exc
        )
