"""Forfeit: a worker gives up its recoverable executions before anyone may judge it dead (it fences
itself off; the per-task fence a recovery raises in Redis is another thing, ``ledger.Fence``).

A sweep judges a worker boot dead once its lease is gone. The heartbeat (``heartbeat.py``) knows until
when its last renewal keeps the lease alive; a safety margin before that instant, unless a renewal came
in time, every execution the boot admitted is *forfeit*: the sweep may recover it at any moment, so it
must not finish over the recovered run. Forfeit means:

- on the prefork pool, the pool process running it kills itself within ``FORFEIT_LATENCY_SECONDS`` of the
  instant, by the clock alone, even when the worker's main process is frozen (``watchdog.py``); on gevent
  and eventlet, the main process kills its green thread (``stop_executions``);
- on every pool, the execution cannot store a result, apply its chain's next link, retry, or save a
  checkpoint: ``guard_task`` checks when the body returns or raises, and ``Task.retry`` first;
- its ledger entry is kept and its message acknowledged, so the task is recovered from the ledger once.

On the solo and threads pools nothing can stop a running execution, so giving it up by the clock would
only hand its task to another worker while its body runs on. There the instant passing gives nothing up
by itself: the heartbeat asks Redis at once, and the generation holds again if its lease is still there
(no sweep can have judged the boot while it is), or is given up if it is gone or Redis cannot say. An
execution that ends meanwhile waits for that answer (``settled``). The heartbeat makes that choice
(``validity.stoppable``) and publishes it with each instant.

The instant is kept in memory shared with the pool processes (``_validity``), so a pool process checks it
without a round trip and without waiting for the main process: a worker thawed after SIGSTOP finds its
executions forfeit whichever of its threads and processes runs first. The memory is made in the main
process; a forked pool process inherits it, a spawned one is handed it when it starts (``adopt``).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import signal
import time
from typing import Any

from billiard.sharedctypes import RawArray
from celery import Task
from celery.exceptions import Retry
from celery.worker import state

from celery_orphans import logs, processes
from celery_orphans.conf import settings
from celery_orphans.exceptions import ExecutionForfeit
from celery_orphans.worker import clock, sockets, watchdog

logger = logs.get(__name__)

# Request attribute, set by the worker's main process when it admits a delivery: the generation of the
# worker boot that admitted it. Each forfeit starts a new generation.
GENERATION = "celery_orphans_generation"

# [0]: until when (clock.now(), the same clock in every process) executions of generation [1] hold;
# [2]: 1.0 if, that instant passed, they wait for the heartbeat's answer instead of being given up by the
# clock (the solo and threads pools), 0.0 if the clock gives them up (every other pool, and a zeroed copy).
# [3]: the instant (clock.now()) at which they stop holding because the main process's presence connection
# was lost and not made again (``presence.py``), 0 while there is none;
# [4]: the main process's last sign of life (clock.now()), written by its deadline thread (``validity.py``);
# [5]: the inode of the presence connection's socket while the main process holds it, 0 otherwise;
# [6]: the last generation a pool process paused an execution of (``pauses``), 0 if none has.
# Created when the worker imports its tasks, before the pool forks, so every forked pool process shares
# it; billiard's, so that it can be handed to a spawned one (its memory is a file billiard passes on).
_validity: Any = RawArray(ctypes.c_double, 7)

SETTLE_POLL_SECONDS = 0.01
# A main process silent this long is looked past: its presence socket's state is read from the kernel.
MAIN_SILENT_SECONDS = 1.0
# How often the kernel is asked meanwhile (a read of its TCP tables).
SOCKET_CHECK_SECONDS = 0.25


def shared() -> Any:
    """The memory the pool processes read the validity from."""
    return _validity


def adopt(validity: Any) -> None:
    """In a spawned pool process: read the validity from the main process's memory, not this copy."""
    global _validity
    _validity = validity


def hold_until(generation: int, valid_until: float, *, by_clock: bool = True) -> None:
    """The heartbeat renewed the lease of ``generation``: its executions hold until ``valid_until``; then,
    unless ``by_clock``, they wait for its answer (``settled``) instead of being given up."""
    # The choice first: a reader that sees the generation sees what its instant passing does.
    _validity[2] = 0.0 if by_clock else 1.0
    _validity[1] = generation
    _validity[0] = valid_until


def withdraw(generation: int) -> None:
    """Every execution of a generation older than ``generation`` is forfeit from now on."""
    # Until first: a reader takes the until, then the generation (see holds()).
    _validity[0] = 0.0
    _validity[1] = generation
    _validity[3] = 0.0  # a new boot: its presence is recorded afresh, or not at all


def holds(generation: int) -> bool:
    """Whether an execution admitted under ``generation`` may still finish."""
    valid_until, presence_until = _validity[0], _validity[3]
    now = clock.now()
    return bool(_validity[1] == generation and now < valid_until and not 0.0 < presence_until <= now)


def pauses(generation: int, resumed: float = 0.0) -> bool:
    """Whether an execution of ``generation`` that does not hold only waits, paused (its process stopped,
    ``watchdog.py``), for its main process to settle it: its generation holds by its lease, only its
    presence connection's loss stops it (``presence_loss.py``), and the main process is alive to
    continue it once a renewal answers that the lease holds, or to end it once the lease does not
    (``settle_paused``). A frozen or stalled main process can do neither: then the
    execution ends at once. ``resumed``: when the asking process came back from a stop of its own (its
    whole worker frozen, then thawed), from which the main process's silence counts."""
    now = clock.now()
    return bool(
        _validity[1] == generation
        and now < _validity[0]
        and 0.0 < _validity[3] <= now
        and now - max(float(_validity[4]), resumed) < MAIN_SILENT_SECONDS
    )


def pausing(generation: int) -> None:
    """A pool process is about to pause an execution of ``generation``: the main process looks for it."""
    _validity[6] = generation


def settle_paused() -> None:
    """In the main process, at each slice of its deadline thread: continue each pool process paused under
    the current generation once that holds again (a renewal sent after the presence loss was answered),
    and kill each one paused under a generation given up since. A stopped process cannot have moved on
    to another task, so the pid read from its request is still its own. Nothing is looked at before the
    first pause, and from then on only the requests admitted under a generation that may have paused.
    The slot is not cleared when none is left: a process may pause as its execution begins, before this
    process has handled the pool's word that it took the job, and its request shows up afterwards."""
    paused = int(_validity[6])
    if not paused:
        return
    generation = int(_validity[1])
    holding = holds(generation)
    requests = list(state.active_requests)
    # A process whose request of a generation given up is still listed (its end not handled yet) may
    # have moved on to an execution of the current one, and paused that: it is that one's to settle.
    current = {
        getattr(r, "worker_pid", None)
        for r in requests
        if getattr(r, "_orphans_generation", None) == generation
    }
    for request in requests:
        admitted, pid = getattr(request, "_orphans_generation", None), getattr(request, "worker_pid", None)
        if admitted is None or admitted > paused:
            continue
        if not pid or pid == os.getpid() or (admitted == generation and not holding):
            continue
        if admitted != generation and pid in current:
            continue
        if processes.stopped(pid):
            signum = signal.SIGCONT if admitted == generation else signal.SIGKILL
            logger.info(
                "%s the paused pool process %s of %s[%s]",
                "continues" if signum == signal.SIGCONT else "kills",
                pid,
                request.name,
                request.id,
            )
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)


def presence_lost(until: float) -> None:
    """The main process's presence connection was lost: executions hold until ``until`` at the latest,
    unless ``presence_kept`` comes first."""
    _validity[3] = until


def presence_kept() -> None:
    """The presence connection lost was made again, or no sweep can judge the boot by it any more."""
    _validity[3] = 0.0


def presence_until() -> float:
    """Until when executions hold for want of a presence connection; 0 while there is nothing to wait for."""
    return float(_validity[3])


def presence_socket(inode: int) -> None:
    """The presence connection's socket is ``inode`` (0: none held, or none a pool process can watch)."""
    _validity[5] = float(inode)


def watched_socket() -> int:
    return int(_validity[5])


def main_alive() -> None:
    """A sign of life from the main process, at each slice of its deadline thread."""
    _validity[4] = clock.now()


class PresenceCheck:
    """Whether the presence connection of a main process silent for ``MAIN_SILENT_SECONDS`` was closed or
    reset by its peer, by the kernel's word (``sockets.py``): read by a pool process's watchdog at each
    of its slices while it runs an execution, which kills the process if so (``watchdog.py``). The kernel
    is asked at most every ``SOCKET_CHECK_SECONDS``, and only while the main process is silent. A slice
    that comes that late says this process was stopped or starved too (a whole worker frozen, then
    thawed): the main process's silence counts from then on, not from before."""

    def __init__(self) -> None:
        self._next = 0.0
        self._last = self._resumed = clock.now()

    def closed(self) -> bool:
        now = clock.now()
        if now - self._last >= MAIN_SILENT_SECONDS:
            self._resumed = now
        self._last = now
        inode = watched_socket()
        if not inode or now - max(float(_validity[4]), self._resumed) < MAIN_SILENT_SECONDS:
            return False
        if now < self._next:
            return False
        self._next = now + SOCKET_CHECK_SECONDS
        # Not established: closed or reset by its peer, though its holder did not close it (it would have
        # said so first, ``presence_socket(0)``). Unreadable tables tell nothing.
        return sockets.established(inode) is False and watched_socket() == inode

    def pauses(self, generation: int) -> bool:
        """``pauses(generation)`` as this process sees it: a main process silent only through a stop they
        shared (a whole worker thawed, ``closed()`` having seen the late slice) gets its time to speak."""
        return pauses(generation, self._resumed)


def settled(generation: int, timeout: float) -> bool:
    """``holds(generation)``; where the clock gives nothing up by itself (``hold_until(by_clock=False)``),
    a generation whose instant passed waits up to ``timeout`` for the heartbeat's answer: held again, or
    given up. So does one that ``pauses``, whose process its watchdog stops meanwhile."""
    deadline = clock.now() + timeout
    while not holds(generation):
        waits = pauses(generation) or (_validity[2] and _validity[1] == generation)
        if not waits or clock.now() >= deadline:
            return False
        time.sleep(SETTLE_POLL_SECONDS)
    return True


def is_forfeit(request: Any) -> bool:
    """Whether the execution ``request`` describes was admitted under a generation that no longer holds."""
    generation = getattr(request, GENERATION, None)
    return isinstance(generation, int) and not settled(generation, float(settings.LEASE_SECONDS))


def refuse_if_forfeit(task: Task[Any, Any], what: str) -> None:
    """Raise ``ExecutionForfeit`` when the running execution of ``task`` is forfeit."""
    if is_forfeit(task.request):
        message = (
            f"{task.name}[{task.request.id}] was forfeit (its worker's lease was not renewed in time); "
            f"it may not {what}: the task is recovered from the ledger instead"
        )
        logger.warning("%s", message)
        raise ExecutionForfeit(message)


class NotStarted(BaseException):
    """A forfeit execution refused before it starts, where its process cannot be killed (the solo,
    threads, gevent and eventlet pools). A ``BaseException``: Celery's signal dispatch lets it through,
    and the pool hands it to the worker's main process as a lost execution (``WorkerLostError``), as it
    does a killed green thread, so the task stays with its ledger entry."""


def before_start(task: Task[Any, Any]) -> None:
    """``task_prerun``, in the process that runs the execution, before Celery stores ``STARTED`` and runs
    the body: an execution whose generation no longer holds (it waited for a pool process while its worker
    was frozen, and its task may be recovered already) neither writes its row nor runs. A prefork pool
    process kills itself, as its watchdog does, and is watched from now on; elsewhere the execution ends
    here by ``NotStarted``."""
    generation = getattr(task.request, GENERATION, None)
    if not isinstance(generation, int):
        return
    if watchdog.watches():
        watchdog.begin(generation)
        return
    if is_forfeit(task.request):
        message = f"{task.name}[{task.request.id}] was forfeit before it started: it is recovered instead"
        logger.warning("%s", message)
        raise NotStarted(message)


def after_run(task: Task[Any, Any]) -> None:
    """``task_postrun``: the execution is over; a prefork pool process stops watching it."""
    if watchdog.watches():
        watchdog.end()


def guard_task(task: Task[Any, Any]) -> None:
    """Make ``task``'s body and ``retry`` refuse to finish for a forfeit execution."""
    if task.__dict__.get("_celery_orphans_guarded"):
        return
    # On the instance, over whatever run is there (Celery's autoretry wraps it on the instance too).
    run, retry = task.run, task.retry

    @functools.wraps(run)
    def guarded_run(*args: Any, **kwargs: Any) -> Any:
        try:
            result = run(*args, **kwargs)  # watched from task_prerun to task_postrun (``before_start``)
        except (ExecutionForfeit, Retry):
            raise  # a Retry comes from a retry() its own check let through: the retry is already sent
        except BaseException as exc:
            if is_forfeit(task.request):
                refuse_if_forfeit(task, f"end with {type(exc).__name__}")
            raise
        refuse_if_forfeit(task, "store its result")
        return result

    @functools.wraps(retry)
    def guarded_retry(*args: Any, **kwargs: Any) -> Any:
        refuse_if_forfeit(task, "retry")
        return retry(*args, **kwargs)

    task.run = guarded_run  # type: ignore[method-assign]
    task.retry = guarded_retry  # type: ignore[method-assign]
    task.__dict__["_celery_orphans_guarded"] = True


def stop_executions(pool: Any, generation: int) -> int:
    """Mark the executions of ``generation`` and older forfeit, and kill their green threads (gevent and
    eventlet: ``GreenletExit`` at the next point where the body yields). Returns how many were marked.

    A running prefork pool process is not killed from here: it kills itself (``watchdog.py``), so a pid
    read from ``active_requests`` can never hit the process once it runs the next task. One paused
    (``pauses``) is killed by ``settle_paused``: stopped, it runs nothing else. On the solo and threads
    pools the execution runs in a thread of this process, which cannot be stopped from outside: the
    body runs to its end, refused only what ``guard_task`` guards."""
    stopped = 0
    for request in list(state.active_requests):
        admitted = getattr(request, "_orphans_generation", None)
        if admitted is None or admitted > generation:
            continue
        request._orphans_forfeit = True
        stopped += 1
        pid = getattr(request, "worker_pid", None)
        if pid and pid != os.getpid() and getattr(pool, "is_green", False):
            try:
                pool.terminate_job(pid, signal.SIGKILL)
            except NotImplementedError:
                pass  # a pool that cannot stop one execution: its outcome is refused all the same
            except OSError as exc:
                logger.info("the pool process of %s[%s] is gone: %s", request.name, request.id, exc)
    return stopped
