"""One sweep at a time across every replica.

On PostgreSQL the lock is a transaction-level advisory lock: it works behind PgBouncer in transaction
pooling and is released when the transaction ends, even if the process holding it dies. A sweep that
hangs while alive is bounded too: its transaction, when it is the sweep's own, gives up a wait for a row
lock, and is ended by PostgreSQL once left idle, after ``SWEEP_STALL_SECONDS``.

On MySQL and MariaDB the lock is a named lock (``GET_LOCK``) of the sweep's session, released when the
block ends or the session does (its process died). A sweep's own transaction is bounded the same way:
its session gives up a wait for a row lock (``innodb_lock_wait_timeout``) and is closed by the server
once left idle (``wait_timeout``), after ``SWEEP_STALL_SECONDS``; both are put back afterwards.

Elsewhere (SQLite) the lock is a Redis lock with an expiry.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Iterator

from django.db import DatabaseError, Error, connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.utils import CursorWrapper
from redis.exceptions import LockError

from celery_orphans.conf import settings
from celery_orphans.exceptions import SweepLocked
from celery_orphans.store import Keys, client

# A stable 32-bit key, so every replica asks PostgreSQL for the same lock.
ADVISORY_LOCK_ID = zlib.crc32(b"celery_orphans.reconcile")
REDIS_LOCK_SECONDS = 300


def lock_kind(using: str = "default") -> str:
    """Where the sweep lock lives: ``"postgresql"``, ``"mysql"`` (MariaDB too) or ``"redis"``."""
    vendor = connections[using].vendor
    return vendor if vendor in {"postgresql", "mysql"} else "redis"


def named_lock(connection: BaseDatabaseWrapper) -> str:
    """The MySQL lock's name: a named lock is the server's, so the name tells databases apart."""
    return f"celery_orphans.reconcile.{zlib.crc32(str(connection.settings_dict['NAME']).encode()):08x}"


@contextlib.contextmanager
def sweep_lock(using: str = "default") -> Iterator[None]:
    """Hold the sweep lock for the block, inside one database transaction; raise ``SweepLocked`` if busy.

    A lock that outlives transactions (MySQL's, Redis's) is taken before the transaction begins and let
    go after it ends, so the next sweep sees everything this one committed.
    """
    own_transaction = not connections[using].in_atomic_block
    kind = lock_kind(using)
    if kind == "postgresql":
        outer: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    elif kind == "mysql":
        outer = _named_lock(using, own_transaction)
    else:
        outer = _redis_lock()
    with outer, transaction.atomic(using=using):
        if kind == "postgresql":
            _take_advisory_lock(using, own_transaction)
        yield
        _refuse_lost_transaction(using)


def _stall_ms() -> int:
    return max(1, round(settings.SWEEP_STALL_SECONDS * 1000))  # 0 would switch the timeouts off


def _take_advisory_lock(using: str, own_transaction: bool) -> None:
    with connections[using].cursor() as cursor:
        if own_transaction:
            # SET LOCAL, in the same round trip: a caller's own transaction keeps its settings.
            stall = str(_stall_ms())
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


@contextlib.contextmanager
def _named_lock(using: str, own_transaction: bool) -> Iterator[None]:
    connection = connections[using]
    name = named_lock(connection)
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT GET_LOCK(%s, 0), @@SESSION.wait_timeout, @@SESSION.innodb_lock_wait_timeout", [name]
        )
        acquired, wait_timeout, lock_wait_timeout = cursor.fetchone()
        if not acquired:
            raise SweepLocked("another reconcile sweep holds the lock")
        if own_transaction:
            stall = math.ceil(_stall_ms() / 1000)  # whole seconds
            cursor.execute("SET SESSION wait_timeout = %s, innodb_lock_wait_timeout = %s", [stall, stall])
    try:
        yield
    finally:
        # A session the server closed (the sweep hung past wait_timeout) released the lock with it.
        with contextlib.suppress(Error), connection.cursor() as cursor:
            if own_transaction:
                cursor.execute(
                    "SET SESSION wait_timeout = %s, innodb_lock_wait_timeout = %s",
                    [wait_timeout, lock_wait_timeout],
                )
            _release_named_lock(cursor, name)


def _release_named_lock(cursor: CursorWrapper, name: str) -> None:
    cursor.execute("DO RELEASE_LOCK(%s)", [name])


@contextlib.contextmanager
def _redis_lock() -> Iterator[None]:
    lock = client().lock(Keys.current().lock, timeout=REDIS_LOCK_SECONDS, blocking=False)
    if not lock.acquire(blocking=False):
        raise SweepLocked("another reconcile sweep holds the lock")
    try:
        yield
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
