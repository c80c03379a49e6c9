"""When a boot's lost presence may be judged, and what a worker does when its own presence connection ends.

Another worker's renewal that finds a boot's presence channel without a subscriber marks it missing; the
boot is judged gone once it has not renewed for its wait since (``wait_seconds``), and no sooner than its
executions are stopped, ``early_seconds`` before its lease's end. A live worker renews within its wait,
and its renewal clears the mark or withdraws its presence. One that cannot renew (its main process
frozen or stalled, or cut off from Redis) must have stopped its executions by the time it may be judged:

- by default a prefork worker whose connection's end is watched by its pool processes stops them
  ``forfeit_seconds`` after its connection ended by itself (its end closed or reset), unless it is made
  again first, so it claims no lease time at all (``early_seconds`` the whole lease). Its main process
  sees the end and arms ``forfeit.presence_lost``, which every process reads. Stopped means *paused*
  while the main process is alive (``forfeit.pauses``): each pool process running a recoverable
  execution stops itself (``SIGSTOP``), and the main process continues it once a renewal sent after the
  loss is answered (the lease held: nothing judged the boot, and its presence is recorded afresh or
  withdrawn), or kills it once its lease is given up (``forfeit.settle_paused``). So a restart of the
  ledger's Redis, or a proxy that refuses the worker while the server is up for the others, costs a
  pause, never a second run, and nothing is given up that need not be. A frozen or stalled main process
  can neither see the end nor continue anything: its pool processes read the socket's state from the
  kernel and end their executions (``forfeit.PresenceCheck``);
- elsewhere (other pools, a socket the kernel does not list, a heartbeat under a second, or
  ``PRESENCE_LOSS_PAUSES`` off) a heartbeat before its lease's end, when its executions are forfeit by
  the lease (``conf.Settings.lease_margin``): presence then tells a death up to a heartbeat sooner than
  the lease;
- a server loading its data is one no sweep uses meanwhile and one just started (another run id), which
  believes no presence recorded before: while it loads, the pause waits (``Loss.loading``).

What is left: Redis's end of the connection closed while the worker's end hears nothing (a middlebox that
resets one end alone, a lost reset) at the moment the worker cannot renew for its wait. The worker then
runs on to its lease's margin while a sweep may judge it after its wait, as it could before presence.
A paused execution holds what it held (a database transaction, a lock) until it is continued or killed:
a recovered copy that needs the same lock waits for the kill, at the lease's margin.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import redis

from celery_orphans import logs
from celery_orphans.conf import settings
from celery_orphans.worker import clock, forfeit, sockets

logger = logs.get(__name__)

# A live worker renews within a heartbeat; this much more covers a renewal sent late or slow to answer.
SLACK_SECONDS = 0.5
# How much sooner than its wait a worker gives its executions up after its connection ended: the time its
# end takes to hear of it and its process to notice, and a pool process's slice.
FORFEIT_SLACK_SECONDS = 1.0
MIN_FORFEIT_SECONDS = 0.5  # less than this, and the connection's end is not worth watching


def wait_seconds() -> float:
    """How long after its presence was seen missing a boot that has not renewed since is judged gone."""
    return float(settings.HEARTBEAT_SECONDS) + SLACK_SECONDS


def forfeit_seconds() -> float:
    """How long after its presence connection ended by itself a worker that watches it gives its executions
    up: its wait less ``FORFEIT_SLACK_SECONDS``; 0 where that is too short to watch for (a heartbeat
    under a second)."""
    seconds = wait_seconds() - FORFEIT_SLACK_SECONDS
    return seconds if seconds >= MIN_FORFEIT_SECONDS else 0.0


def early_seconds(stoppable: bool = True) -> float:
    """How long before its lease's end in Redis this worker's executions are forfeit at the latest when
    its presence connection is lost: its margin (``conf.Settings.lease_margin``) less the clock skew and
    the forfeit's latency, which it keeps as slack. Its presence lost is not judged sooner. Not at all
    where its pool cannot stop them (``validity.stoppable``): its lease's end alone tells."""
    return float(settings.HEARTBEAT_SECONDS) if stoppable else 0.0


def server_loading(exc: BaseException) -> bool:
    """Whether ``exc`` says the Redis server is loading its data: a server just started, which no sweep
    can use meanwhile and which believes no presence recorded before (its run id is new). A refused
    connection says nothing of the kind: a proxy, a sidecar or a firewall on the worker's way refuses
    too while the server is up for every other worker."""
    return isinstance(exc, redis.BusyLoadingError)


def _pause_ahead() -> bool:
    """Whether a presence loss's pause is armed and has not begun: no execution can be paused yet."""
    return forfeit.presence_until() > clock.now()


class Loss:
    """The end of one worker's presence connection, from the moment it ended by itself until a renewal sent
    since is answered; its executions stop holding unless the connection is made again first.
    ``on_loss()``: the heartbeat renews at once.

    A connection made again holds the forfeit off while it lasts, and no longer: a sweep that marked the
    boot missing while it was lost keeps its mark until a renewal clears it, and judges the boot by it the
    moment the connection ends again. So a loss that follows before a renewal is answered is counted from
    the first one's instant, not its own: a connection that keeps ending while renewals fail forfeits the
    executions as a single lost one would."""

    def __init__(self, node: str, on_loss: Callable[[], None]) -> None:
        self.node = node
        self._on_loss = on_loss
        self._lost_at: float | None = None  # clock.now() of the last loss, while none is made good
        self._since = 0.0  # clock.now() of the first loss no renewal has made good
        self._armed = False  # lost and not made again since: the forfeit is armed
        self._lock = threading.Lock()  # the presence thread arms, the heartbeat's may disarm

    @property
    def armed(self) -> bool:
        return self._armed

    def claim(self, fileno: int, stoppable: bool, self_watching: bool) -> int:
        """A subscription was made on socket ``fileno``: the ``early_ms`` its renewals record. The whole
        lease where its pool processes can watch that socket (a TCP one the kernel lists) and its loss
        forfeits its executions in time; else ``early_seconds``."""
        watched = (
            settings.PRESENCE_LOSS_PAUSES
            and self_watching
            and forfeit_seconds() > 0
            and sockets.watchable(fileno)
        )
        # The socket first, then the claim a renewal records: a pool process must watch the connection
        # that a sweep may judge the boot by.
        forfeit.presence_socket(sockets.inode(fileno) if watched else 0)
        return int((settings.LEASE_SECONDS if watched else early_seconds(stoppable)) * 1000)

    def lost(self, early_ms: int) -> None:
        """The connection ended by itself (its end closed or reset) after a subscription that claimed
        ``early_ms``: unless it is made again, or a renewal sent from now on is answered, the executions
        stop in ``forfeit_seconds``."""
        if early_ms < int(settings.LEASE_SECONDS * 1000) or not forfeit_seconds():
            return  # judged no sooner than its executions are forfeit by the lease: nothing to do
        with self._lock:
            self._lost_at = now = clock.now()
            self._since = self._since or now
            self._armed = True
            forfeit.presence_lost(self._since + forfeit_seconds())
        logger.info("the presence connection of %s ended; it connects again and renews at once", self.node)
        self._on_loss()

    def loading(self) -> None:
        """The server the connection was made again to is loading its data: the pause waits from now, if
        it has not begun. Once its instant passed, the executions may be paused and a sweep may have
        judged the boot before the server went down: a server loading says nothing of that, and only a
        renewal continues them (``renewed``), as for ``kept``."""
        with self._lock:
            if self._armed and _pause_ahead():
                forfeit.presence_lost(clock.now() + forfeit_seconds())

    def renewed(self, sent_at: float) -> None:
        """A renewal sent at ``sent_at`` (clock.now()) was answered: sent after the loss, it recorded the
        boot's presence afresh or withdrew it (``scripts.PRESENCE``), so no sweep judges the boot by the
        presence it lost."""
        with self._lock:
            if self._lost_at is not None and sent_at > self._lost_at:  # after the last loss: after every one
                self._lost_at, self._since = None, 0.0
                self._disarm()

    def kept(self) -> None:
        """The connection was made again: before the executions stopped, nothing to stop while it lasts
        (no sweep judges a subscribed boot); the loss is made good only by a renewal (``renewed``). Once
        they stopped, a sweep may have judged the boot meanwhile: only a renewal continues them."""
        with self._lock:
            if _pause_ahead():
                self._disarm()

    def closed(self) -> None:
        """The connection is closed on purpose: nothing to forfeit."""
        with self._lock:
            self._lost_at, self._since = None, 0.0
            self._disarm()

    def _disarm(self) -> None:
        if self._armed:
            self._armed = False
            forfeit.presence_kept()
