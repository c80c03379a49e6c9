"""Redis calls that never outlast the time their caller gives them.

redis-py's own client waits up to its socket timeout for each try, retries, and retries inside
``connect()``: against a peer that drops packets without closing (a partition, a frozen proxy, a dead NAT
entry) that adds up to tens of seconds. A ``Line`` is one connection of its own, made without retries,
whose every call (connecting included) is bounded by the seconds given: the heartbeat gives what is left of
its validity, so a renewal never runs past the instant the lease may lapse. Through Redis Sentinel, the
question of where the master is, asked as the connection is made, is bounded too: redis-py asks each
sentinel in turn, each for up to its own socket timeout.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.connection import AbstractConnection
from redis.retry import Retry
from redis.sentinel import MasterNotFoundError, SentinelConnectionPool

# The least time a call is given: below it, not even a healthy Redis on the same machine answers reliably.
SHORTEST_SECONDS = 0.05


class NotSent(redis.ConnectionError):
    """A call that failed before any of its commands was sent (its connection could not be made in
    time): none of them reached Redis, nor ever will."""


class Line:
    """One connection to the Redis of ``client`` (its URL, credentials, TLS, sentinels), without retries."""

    def __init__(self, client: redis.Redis[bytes], name: str) -> None:
        self.client = client
        pool = client.connection_pool
        self._lookup = _MasterLookup(pool) if isinstance(pool, SentinelConnectionPool) else None
        # No health check: it would be one more unbounded round trip. A call that fails drops the
        # connection, and the next one connects anew (through a sentinel, to wherever the master is now).
        self._conn: AbstractConnection = pool.connection_class(
            **{
                **pool.connection_kwargs,
                "health_check_interval": 0,
                "retry": Retry(NoBackoff(), 0),
                "client_name": name,
                **({"connection_pool": self._lookup} if self._lookup is not None else {}),
            }
        )

    def execute(self, commands: Sequence[Sequence[Any]], seconds: float) -> list[Any]:
        """Send ``commands`` at once and read their replies, all within ``seconds`` from now. A reply that
        is an error is returned as its exception; ``redis.ConnectionError`` or ``redis.TimeoutError``
        when the time ran out or the connection failed (it is closed then)."""
        deadline = time.monotonic() + max(seconds, SHORTEST_SECONDS)
        conn: Any = self._conn  # redis-py's stubs know neither bytes commands nor a read's timeout
        if self._lookup is not None:
            self._lookup.deadline = deadline
        try:
            try:
                self._bound(conn, deadline)
                conn.connect()
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                raise NotSent(str(exc)) from exc
            self._bound(conn, deadline)
            conn.send_packed_command(conn.pack_commands(commands), check_health=False)
            replies: list[Any] = []
            for _ in commands:
                self._bound(conn, deadline)  # the socket's timeout: redis-py 5 reads take no timeout
                try:
                    replies.append(conn.read_response())
                except redis.ResponseError as exc:
                    replies.append(exc)
            return replies
        except (redis.ConnectionError, redis.TimeoutError):
            conn.disconnect()
            raise

    @staticmethod
    def _left(deadline: float) -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise redis.TimeoutError("no time left for the call")
        return left

    @classmethod
    def _bound(cls, conn: Any, deadline: float) -> None:
        left = cls._left(deadline)
        conn.socket_timeout = conn.socket_connect_timeout = left
        sock = getattr(conn, "_sock", None)
        if sock is not None:
            sock.settimeout(left)

    def close(self) -> None:
        self._conn.disconnect()

    def detach(self) -> AbstractConnection:
        """The line's connection, for a caller that goes on using it on its own (the line is not used
        again): its socket waits as the client's own would again, for what its new owner reads on it."""
        conn: Any = self._conn
        kwargs = self.client.connection_pool.connection_kwargs
        conn.socket_timeout = kwargs.get("socket_timeout")
        conn.socket_connect_timeout = kwargs.get("socket_connect_timeout")
        sock = getattr(conn, "_sock", None)
        if sock is not None:
            sock.settimeout(conn.socket_timeout)
        return self._conn


class _MasterLookup:
    """What a Sentinel-managed connection asks where its master is, in place of its pool's own proxy: the
    same question to each sentinel in turn, on a connection of its own that gives up at ``deadline``
    (``time.monotonic()``), which the ``Line`` sets before each call."""

    is_master = True
    check_connection = False  # no PING on connect: one more round trip

    def __init__(self, pool: SentinelConnectionPool) -> None:
        self.service_name: str = pool.service_name
        self._manager: Any = pool.sentinel_manager
        self.deadline = 0.0

    def get_master_address(self) -> tuple[str, int]:
        errors = []
        for sentinel in list(self._manager.sentinels):
            left = Line._left(self.deadline)
            sentinel_pool = sentinel.connection_pool
            asked = redis.Redis(
                connection_pool=redis.ConnectionPool(
                    connection_class=sentinel_pool.connection_class,
                    **{
                        **sentinel_pool.connection_kwargs,
                        "socket_timeout": left,
                        "socket_connect_timeout": left,
                        "retry": Retry(NoBackoff(), 0),
                        "health_check_interval": 0,
                    },
                )
            )
            try:
                masters: Any = asked.execute_command("SENTINEL MASTERS")
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                errors.append(repr(exc))
                continue
            finally:
                asked.close()
                asked.connection_pool.disconnect()
            state = masters.get(self.service_name)
            if state and self._manager.check_master_state(state, self.service_name):
                forced = getattr(self._manager, "_force_master_ip", None)
                return (forced if forced is not None else state["ip"]), int(state["port"])
        raise MasterNotFoundError(f"no sentinel names a master for {self.service_name!r}: {errors}")

    def rotate_slaves(self) -> Any:  # a master's connection never asks; redis-py's type requires it
        raise MasterNotFoundError("the bounded line reaches masters only")
