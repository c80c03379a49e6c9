"""A prefork pool process ends its own stale execution at the instant its generation stops holding.

The worker's main process may be frozen or blocked (SIGSTOP, a hung call) while its pool processes run on;
nothing it does can then stop them, and the sweep recovers their tasks once the lease lapses in Redis. So
each pool process watches the clock from a thread of its own: when the execution it runs no longer holds
(``forfeit.holds``, read from memory shared with the main process: no I/O), the process kills itself. It kills
itself, not a pid read elsewhere, so the kill can never hit the next task that process runs.

An execution stopped only by the loss of its main process's presence connection (``presence_loss.py``)
is paused, not ended, while its main process is alive: the process stops itself (``SIGSTOP``), and the
main process continues it once a renewal answers that the boot's lease holds (a restart of the ledger's
Redis, a connection dropped by the network: nothing was judged), or kills it once the lease does not
(``forfeit.settle_paused``). A stopped process acts no more than a dead one, so a sweep may judge the boot
meanwhile; and nothing is given up that need not be.

Nor does it outlive the presence of a main process that cannot speak for itself. A boot whose presence
connection Redis dropped may be judged gone a heartbeat and a half after another worker saw it
(``presence.py``); a live main process makes the connection again, or gives its executions up, well
before. A frozen or stalled one can do neither, but the kernel knows its socket was closed or reset: when
the main process has given no sign of life for a while, the thread reads the socket's state from the
kernel and kills the process if it is no longer established (``forfeit.PresenceCheck``).

Nor does an execution outlive the worker's main process. Celery has the kernel kill each prefork pool
process the moment its main process dies (``PR_SET_PDEATHSIG``); should that not have been done, the
thread sees its parent gone and kills the process. A dead main process renews no lease, so the execution
would be forfeit at its instant anyway; dying with it is what lets Redis's word that the main process is
gone (``presence.py``) be acted on at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator

from celery_orphans import logs
from celery_orphans.conf import FORFEIT_LATENCY_SECONDS

logger = logs.get(__name__)

# The generation of the execution this process runs, while it runs; guarded by _lock, so that the kill
# never lands between the end of one execution and the start of the next.
_running: int | None = None
_lock = threading.Lock()
_watcher: int | None = None  # the pid whose watchdog thread runs
_parent: int | None = None  # the worker's main process, which made this pool process
_owner: int | None = None  # the thread that holds _lock, while one does (``_continued`` must not wait on it)


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    global _owner
    with _lock:
        _owner = threading.get_ident()
        try:
            yield
        finally:
            _owner = None


@dataclasses.dataclass(frozen=True)
class Rules:
    """What the watchdog asks of the shared validity (``forfeit.py``): whether an execution of a generation
    ``holds``, whether one that does not ``pauses`` (and says it is ``pausing`` before it stops), and
    whether a silent main process's presence connection was ``presence_closed`` by the kernel's word."""

    holds: Callable[[int], bool]
    pauses: Callable[[int], bool]
    pausing: Callable[[int], None]
    presence_closed: Callable[[], bool]


_rules: Rules | None = None


def _orphaned() -> bool:
    """Whether the main process that made this pool process is gone."""
    return _parent is not None and os.getppid() != _parent


def watches() -> bool:
    """Whether this process is a prefork pool process whose watchdog runs (``start``)."""
    return _watcher == os.getpid()


def begin(generation: int) -> None:
    """Watch an execution of ``generation`` from before Celery stores its ``STARTED`` (``task_prerun``),
    in a pool process that watches; kill this process now if the execution is forfeit already (a job
    handed to the pool before its worker was frozen, and picked up after its boot was given up), or
    pause it if it waits for its presence loss to be settled."""
    global _running
    with _locked():
        _running = generation
        _check(generation, presence=False)


def end() -> None:
    """The execution ended (``task_postrun``): nothing runs to watch until the next begins."""
    global _running
    with _locked():
        _running = None


def start(rules: Rules) -> None:
    """Watch from now on, in this prefork pool process (``handover.initialize``), by ``rules``."""
    global _watcher, _running, _lock, _parent, _rules, _owner
    if _watcher == os.getpid():
        return
    _running, _lock, _owner = None, threading.Lock(), None  # a fork may have caught the parent's held
    _rules = rules
    _watcher = os.getpid()
    _parent = os.getppid()
    threading.Thread(target=_watch, name="celery-orphans-watchdog", daemon=True).start()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGCONT, _continued)


# How often the body's thread, continued while its execution does not hold, looks again.
CONTINUED_POLL_SECONDS = 0.005


def _continued(signum: int, frame: object) -> None:
    """``SIGCONT``, run by Python in the process's main thread, the one that runs the body, before the
    body's next bytecode. A paused process continued by anyone but its main process (an operator's
    ``kill -CONT``, a supervisor, a whole process group continued) runs every thread at once, and the
    body's would act before the watchdog's could stop the process again (the GIL changes hands: the
    switch interval ran out while stopped): 5 side effects over 2.6 s after its task's recovered
    execution had started, from 142 continues 20 ms apart. So the body waits here while its execution
    does not hold: the watchdog stops the process again, or ends it; once its main process continued it,
    it holds, and the body goes on."""
    if _owner == threading.get_ident():
        return  # continued inside its own check (``begin``), or holding the lock: it looks again itself
    while _running is not None and _rules is not None and not _rules.holds(_running):
        time.sleep(CONTINUED_POLL_SECONDS)


def _watch() -> None:
    stop = threading.Event()  # never set: a sliced wait
    while not stop.wait(FORFEIT_LATENCY_SECONDS):
        with _locked():
            if _running is not None:
                _check(_running, presence=True)


def _check(generation: int, *, presence: bool) -> None:
    """Under ``_lock``: end this process if its execution of ``generation`` may not go on, or stop it
    (until its main process continues or kills it) if it pauses; ``presence``: and if the kernel says a
    silent main process's presence connection was closed. Once continued, it looks again (a pause is
    logged once, however often it is continued: by its main process, or by anyone else)."""
    assert _rules is not None
    said = False
    while True:
        if _orphaned() or (presence and _rules.presence_closed()):
            break
        if _rules.holds(generation):
            return
        if not _rules.pauses(generation):
            break
        _rules.pausing(generation)
        if not said:
            said = True
            logger.warning(
                "pool process %s pauses its execution: the presence connection of its worker was lost; "
                "it goes on once a renewal answers that the lease holds, or is killed once the lease is "
                "given up",
                os.getpid(),
            )
        # To this thread: it takes the signal on its way back from the call and stops the process there.
        # Sent to the process, any thread may take it, and this one ran on (and looped, logging again)
        # until another got round to stopping them all.
        signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
    # The main process sees this process die, and acknowledges the task as forfeit.
    os.kill(os.getpid(), signal.SIGKILL)
