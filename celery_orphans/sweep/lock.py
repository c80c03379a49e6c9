"""One sweep at a time across every replica.

On PostgreSQL the lock is a transaction-level advisory lock: it works behind PgBouncer in transaction
pooling and is released when the transaction ends, even if the process holding it dies. A sweep that
hangs while alive is bounded too: its transaction, when it is the sweep's own, gives up a wait for a row
lock, and is ended by PostgreSQL once left idle, after ``SWEEP_STALL_SECONDS``. Elsewhere the lock is a
Redis lock with an expiry.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Iterator

from django.db import DatabaseError, connections, transaction
from redis.exceptions import LockError

from celery_orphans.conf import settings
from celery_orphans.exceptions import SweepLocked
from celery_orphans.store import Keys, client

# A stable 32-bit key, so every replica asks PostgreSQL for the same lock.
ADVISORY_LOCK_ID = zlib.crc32(b"celery_orphans.reconcile")
REDIS_LOCK_SECONDS = 300


def uses_advisory_lock(using: str = "default") -> bool:
    return connections[using].vendor == "postgresql"


@contextlib.contextmanager
def sweep_lock(using: str = "default") -> Iterator[None]:
    """Hold the sweep lock for the block, inside one database transaction; raise ``SweepLocked`` if busy."""
    own_transaction = not connections[using].in_atomic_block
    with transaction.atomic(using=using):
        if uses_advisory_lock(using):
            with connections[using].cursor() as cursor:
                if own_transaction:
                    # SET LOCAL, in the same round trip: a caller's own transaction keeps its settings.
                    stall = str(max(1, round(settings.SWEEP_STALL_SECONDS * 1000)))  # ms; 0 is off
                    cursor.execute(
                        "SELECT pg_try_advisory_xact_lock(%s), set_config('lock_timeout', %s, true),"
                        " set_config('idle_in_transaction_session_timeout', %s, true)",
                        [ADVISORY_LOCK_ID, stall, stall],
                    )
                else:
                    cursor.execute("SELECT pg_try_advisory_xact_lock(%s)", [ADVISORY_LOCK_ID])
                acquired = cursor.fetchone()[0]
            if not acquired:
                raise SweepLocked("another reconcile sweep holds the lock")
            yield
            _refuse_lost_transaction(using)
            return
        lock = client().lock(Keys.current().lock, timeout=REDIS_LOCK_SECONDS, blocking=False)
        if not lock.acquire(blocking=False):
            raise SweepLocked("another reconcile sweep holds the lock")
        try:
            yield
            _refuse_lost_transaction(using)
        finally:
            with contextlib.suppress(LockError):
                lock.release()


def _refuse_lost_transaction(using: str) -> None:
    # A failure inside an action's savepoint that could not be rolled back (the connection was lost)
    # dooms the whole transaction; leaving the atomic block would roll it back without a word while
    # the sweep reports its actions as done.
    if connections[using].needs_rollback:
        raise DatabaseError(
            "the database connection failed part way through the sweep: nothing it recorded was kept; "
            "the next sweep finds every task again"
        )
