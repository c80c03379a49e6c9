"""The loss of a worker's presence connection, in this process (worker/presence_loss.py, the presence part of
worker/forfeit.py, worker/sockets.py): when the executions stop holding, what makes the loss good, and what
a pool process reads from the kernel of a socket its main process holds. Real sockets; the end-to-end cases
with real workers are in test_presence_loss.py and test_presence_attacks.py."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest

from celery_orphans.worker import clock, forfeit, sockets
from celery_orphans.worker.presence_loss import Loss, forfeit_seconds, server_loading

pytestmark = pytest.mark.usefixtures("shared_validity")


@pytest.fixture
def connected() -> Iterator[tuple[socket.socket, socket.socket]]:
    """A TCP connection on this machine: the client's end, and the server's."""
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    listener.close()
    yield client, server
    for end in (client, server):
        end.close()


@pytest.fixture
def lease_ms(settings: Any) -> int:
    """The default timings (the suite's heartbeat is too short for a loss to be watched): the
    ``early_ms`` a watched subscription claims."""
    settings.CELERY_ORPHANS_HEARTBEAT_SECONDS = 2
    settings.CELERY_ORPHANS_LEASE_SECONDS = 10
    return 10_000


def test_executions_stop_holding_when_a_lost_presence_is_not_made_good_in_time():
    forfeit.hold_until(3, clock.now() + 60)
    forfeit.presence_lost(clock.now() + 60)
    assert forfeit.holds(3)  # the loss's instant is still ahead

    forfeit.presence_lost(clock.now() - 0.01)
    assert not forfeit.holds(3)
    forfeit.presence_kept()
    assert forfeit.holds(3)  # made good: the lease alone again


def test_a_new_generation_does_not_inherit_the_loss_of_the_boot_given_up():
    forfeit.hold_until(3, clock.now() + 60)
    forfeit.presence_lost(clock.now() - 0.01)
    forfeit.withdraw(4)
    forfeit.hold_until(4, clock.now() + 60)

    assert forfeit.holds(4)


def test_a_renewal_makes_a_loss_good_only_if_it_was_sent_after_it(lease_ms: int):
    forfeit.hold_until(3, clock.now() + 60)
    woken = []
    loss = Loss("w@test", lambda: woken.append(True))
    before = clock.now()
    loss.lost(lease_ms)
    assert woken == [True] and loss.armed  # the heartbeat renews at once
    assert 0 < forfeit.presence_until() - clock.now() <= forfeit_seconds()

    loss.renewed(before)  # sent before the loss: its script may have seen the subscription
    assert loss.armed and forfeit.presence_until() > 0
    loss.renewed(clock.now())
    assert not loss.armed and forfeit.presence_until() == 0.0


def test_a_subscription_that_claims_no_lease_time_forfeits_nothing_when_lost(lease_ms: int):
    loss = Loss("w@test", lambda: None)
    loss.lost(lease_ms - 1)  # judged no sooner than its lease's margin: nothing to do

    assert not loss.armed and forfeit.presence_until() == 0.0


def test_a_server_loading_its_data_holds_the_forfeit_off_while_armed(lease_ms: int):
    loss = Loss("w@test", lambda: None)
    loss.loading()
    assert forfeit.presence_until() == 0.0  # nothing lost: nothing to hold off

    loss.lost(lease_ms)
    forfeit.presence_lost(clock.now() + 0.01)  # about to run out
    loss.loading()
    assert forfeit.presence_until() - clock.now() > forfeit_seconds() - 0.1


# Once the instant passed, the executions are paused and a sweep may have judged the boot before the server
# restarted: its loading continues nothing (before, it moved the instant ahead, and the main process
# continued an execution whose task ran elsewhere; test_presence_pause_attacks.py).
def test_a_server_loading_its_data_does_not_continue_a_paused_execution(lease_ms: int):
    forfeit.hold_until(3, clock.now() + 60)
    loss = Loss("w@test", lambda: None)
    loss.lost(lease_ms)
    passed = clock.now() - 0.01
    forfeit.presence_lost(passed)
    loss.loading()

    assert forfeit.presence_until() == passed and not forfeit.holds(3)


def test_only_a_server_loading_its_data_says_no_sweep_could_judge():
    import redis

    assert server_loading(redis.BusyLoadingError("Redis is loading the dataset in memory"))
    # A proxy, a sidecar or a firewall on the worker's way refuses while the server is up for others.
    refused = redis.ConnectionError("Error 111 connecting to 127.0.0.1:6399. Connection refused.")
    assert not server_loading(refused)
    assert not server_loading(redis.TimeoutError("Timeout connecting to server"))
    assert not server_loading(redis.ConnectionError("Connection closed by server."))


def test_the_kernel_tells_a_socket_closed_by_its_peer(connected: tuple[socket.socket, socket.socket]):
    client, server = connected
    inode = sockets.inode(client.fileno())
    assert sockets.watchable(client.fileno())
    assert sockets.established(inode) is True

    server.close()  # the peer's FIN: the client's end is in CLOSE_WAIT, open but no longer established

    assert sockets.established(inode) is False


def test_a_pool_process_reads_the_kernel_only_while_its_main_process_is_silent(
    connected: tuple[socket.socket, socket.socket],
):
    client, server = connected
    forfeit.presence_socket(sockets.inode(client.fileno()))
    server.close()
    check = forfeit.PresenceCheck()
    check._resumed -= 2 * forfeit.MAIN_SILENT_SECONDS  # the watchdog has been slicing for a while

    forfeit.main_alive()
    assert not check.closed()  # the main process speaks for its connection
    forfeit._validity[4] = clock.now() - forfeit.MAIN_SILENT_SECONDS - 0.1
    assert check.closed()
    forfeit.presence_socket(0)  # its holder closed it on purpose, or holds none
    assert not check.closed()


def thawed(connected: tuple[socket.socket, socket.socket]) -> forfeit.PresenceCheck:
    """A pool process's check, its presence connection closed by its peer (as a restart of Redis does)
    while this process and its main process were stopped together 10 s; neither has spoken since."""
    client, server = connected
    forfeit.presence_socket(sockets.inode(client.fileno()))
    server.close()
    check = forfeit.PresenceCheck()
    forfeit._validity[4] = clock.now() - 10  # the main process's last word, before the stop
    check._last = check._resumed = clock.now() - 10  # this process's last slice, before the stop too
    return check


def test_a_pool_process_stopped_with_its_main_process_does_not_count_their_common_stop_as_silence(
    connected: tuple[socket.socket, socket.socket],
):
    check = thawed(connected)

    assert not check.closed()  # thawed together: the main process gets its time to speak
    check._resumed -= 2 * forfeit.MAIN_SILENT_SECONDS  # and did not, a second after the thaw
    assert check.closed()


def test_an_execution_thawed_with_its_main_process_pauses_before_that_process_speaks(
    connected: tuple[socket.socket, socket.socket],
):
    """A whole worker frozen across the loss of its presence connection (a ledger restart), then thawed:
    the pool process's watchdog may look before its main process ticks. Their common stop is no silence
    of the main process: the execution pauses, for the main process to settle it, instead of ending as
    under a stalled main process (CI saw such a thaw end the execution, and the task ran again)."""
    check = thawed(connected)
    forfeit.hold_until(3, clock.now() + 60)
    forfeit.presence_lost(clock.now() - 5)  # its instant passed during the stop

    assert not forfeit.pauses(3)  # by the main process's silence alone, it would end
    assert not check.closed()  # the first slice after the thaw
    assert check.pauses(3)
    check._resumed -= 2 * forfeit.MAIN_SILENT_SECONDS  # and the main process did not speak within a second
    assert not check.pauses(3)


def test_a_connection_made_again_holds_the_forfeit_off_but_only_a_renewal_makes_its_loss_good(lease_ms: int):
    # A sweep that marked the boot missing while its connection was lost keeps the mark until a renewal
    # clears it, and may judge by it the moment the connection ends again: that loss counts from the first.
    forfeit.hold_until(3, clock.now() + 60)
    loss = Loss("w@test", lambda: None)
    loss.lost(lease_ms)
    first = forfeit.presence_until()
    loss.kept()
    assert not loss.armed and forfeit.presence_until() == 0.0 and forfeit.holds(3)

    sent = clock.now()  # a renewal sent between the two losses: its script may have seen the first alone
    loss.lost(lease_ms)
    assert loss.armed and forfeit.presence_until() == first
    loss.renewed(sent)
    assert loss.armed and forfeit.presence_until() == first

    loss.renewed(clock.now())
    loss.kept()
    loss.lost(lease_ms)
    assert forfeit.presence_until() > first  # made good: the next loss is a loss of its own


def test_a_connection_closed_on_purpose_leaves_no_loss_behind(lease_ms: int):
    loss = Loss("w@test", lambda: None)
    loss.lost(lease_ms)
    first = forfeit.presence_until()
    loss.closed()
    assert not loss.armed and forfeit.presence_until() == 0.0

    loss.lost(lease_ms)
    assert forfeit.presence_until() > first


def test_an_execution_stopped_by_its_presence_loss_alone_pauses_while_its_main_process_is_alive():
    forfeit.hold_until(3, clock.now() + 60)
    forfeit.main_alive()
    assert not forfeit.pauses(3)  # it holds: nothing to wait for

    forfeit.presence_lost(clock.now() - 0.01)
    assert not forfeit.holds(3) and forfeit.pauses(3)
    assert not forfeit.pauses(2)  # a generation given up ends
    forfeit._validity[4] = clock.now() - forfeit.MAIN_SILENT_SECONDS - 0.1
    assert not forfeit.pauses(3)  # a silent main process could neither continue nor end it: it ends
    forfeit.main_alive()
    forfeit.hold_until(3, clock.now() - 0.01)
    assert not forfeit.pauses(3)  # its lease's margin passed: it ends


def test_once_the_executions_paused_only_a_renewal_continues_them(lease_ms: int):
    # A sweep may have judged the boot while they were paused: a connection made again says nothing of
    # that; a renewal answered says its lease holds.
    forfeit.hold_until(3, clock.now() + 60)
    loss = Loss("w@test", lambda: None)
    loss.lost(lease_ms)
    forfeit.presence_lost(clock.now() - 0.01)  # the pause began
    loss.kept()
    assert loss.armed and not forfeit.holds(3)

    loss.renewed(clock.now())
    assert not loss.armed and forfeit.holds(3)


class Running:
    """What the main process reads of an active request of ``generation`` run by pool process ``pid``."""

    def __init__(self, pid: int, generation: int = 3) -> None:
        self._orphans_generation, self.worker_pid, self.name, self.id = generation, pid, "t", "i"


@pytest.fixture
def paused_process() -> Iterator[Any]:
    """A real process stopped by SIGSTOP, as a pool process pauses itself, and a request of generation 3
    that it runs, among the worker's active requests."""
    import signal
    import subprocess
    import sys

    from celery.worker import state

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    request = Running(child.pid)
    try:
        child.send_signal(signal.SIGSTOP)
        wait_until_stopped(child.pid)
        state.active_requests.add(request)  # weakly: the fixture holds it
        forfeit.pausing(3)
        yield child
    finally:
        state.active_requests.discard(request)
        child.kill()
        child.wait()


def wait_until_stopped(pid: int) -> None:
    import time

    from celery_orphans import processes

    deadline = time.monotonic() + 5
    while not processes.stopped(pid):
        assert time.monotonic() < deadline, "the process did not stop"
        time.sleep(0.01)


def test_the_main_process_continues_a_paused_pool_process_once_its_generation_holds_again(
    paused_process: Any,
) -> None:
    from celery_orphans import processes

    forfeit.hold_until(3, clock.now() + 60)
    forfeit.presence_lost(clock.now() - 0.01)
    forfeit.settle_paused()
    assert processes.stopped(paused_process.pid)  # the loss is not made good: it waits

    forfeit.presence_kept()  # a renewal sent after the loss was answered
    forfeit.settle_paused()
    assert paused_process.poll() is None and not processes.stopped(paused_process.pid)


def test_the_main_process_kills_a_paused_pool_process_once_its_generation_is_given_up(
    paused_process: Any,
) -> None:
    forfeit.hold_until(3, clock.now() + 60)
    forfeit.presence_lost(clock.now() - 0.01)
    forfeit.withdraw(4)  # its lease's margin passed, or a renewal found the lease gone
    forfeit.hold_until(4, clock.now() + 60)
    forfeit.settle_paused()

    assert paused_process.wait(timeout=5) == -9
    assert forfeit._validity[6] == 3.0  # its request is still active until the worker reaps it

    from celery.worker import state

    state.active_requests.clear()
    forfeit.settle_paused()
    # Kept: a process that paused as its execution began may have its request show up only now
    # (test_forfeit.py).
    assert forfeit._validity[6] == 3.0


# A paused pool process continued by anyone: the body's thread (SIGCONT's handler runs there) waits while
# its execution does not hold, for the watchdog to stop the process again or end it, and goes on once it
# holds. Continued inside its own check (a pause as the execution began, ``watchdog.begin``), it returns
# at once: it holds the lock the watchdog would need, and looks again itself.
def test_a_continued_body_waits_until_its_execution_holds_unless_it_is_the_one_checking(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import signal
    import threading
    import time

    from celery_orphans.worker import watchdog

    holding = threading.Event()
    rules = watchdog.Rules(lambda g: holding.is_set(), lambda g: True, lambda g: None, lambda: False)
    monkeypatch.setattr(watchdog, "_rules", rules)
    monkeypatch.setattr(watchdog, "_running", 7)
    monkeypatch.setattr(watchdog, "_lock", threading.Lock())

    with watchdog._locked():
        began = time.monotonic()
        watchdog._continued(signal.SIGCONT, None)
        assert time.monotonic() - began < 0.05  # not a wait on itself

    threading.Timer(0.2, holding.set).start()
    began = time.monotonic()
    watchdog._continued(signal.SIGCONT, None)
    assert 0.15 < time.monotonic() - began < 1.0


def test_a_process_that_moved_on_from_an_execution_given_up_is_continued_not_killed(paused_process: Any):
    # Its execution of generation 3 ended and the worker has not handled that yet, while the process took
    # one of generation 4 and paused it: that one is continued once generation 4 holds.
    from celery.worker import state

    from celery_orphans import processes

    forfeit.withdraw(4)
    forfeit.hold_until(4, clock.now() + 60)
    forfeit.presence_lost(clock.now() - 0.01)  # generation 4's executions pause
    forfeit.pausing(4)
    later = Running(paused_process.pid, generation=4)
    state.active_requests.add(later)
    try:
        forfeit.settle_paused()
        assert paused_process.poll() is None and processes.stopped(paused_process.pid)  # it waits

        forfeit.presence_kept()  # a renewal sent after the loss was answered
        forfeit.settle_paused()
    finally:
        state.active_requests.discard(later)

    assert paused_process.poll() is None and not processes.stopped(paused_process.pid)
