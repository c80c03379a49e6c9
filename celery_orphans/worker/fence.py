"""Self-fencing: a worker gives up its recoverable executions before anyone may judge it dead.

A sweep judges a worker boot dead once its lease is gone. The heartbeat (``heartbeat.py``) knows until
when its last renewal keeps the lease alive; a safety margin before that instant, unless a renewal came
in time, every execution the boot admitted is *forfeit*: the sweep may recover it at any moment, so it
must not finish over the recovered run. Forfeit means:

- on the prefork pool, the pool process running it is killed at once (``stop_executions``);
- on every pool, the execution cannot store a result, apply its chain's next link, retry, or save a
  checkpoint: ``guard_task`` checks when the body returns or raises, and ``Task.retry`` first;
- its ledger entry is kept and its message acknowledged, so the task is recovered from the ledger once.

The instant is kept in memory shared with the pool processes (``_validity``), so a pool process checks it
without a round trip and without waiting for the main process: a worker thawed after SIGSTOP finds its
executions forfeit whichever of its threads and processes runs first.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import multiprocessing
import os
import signal
import time
from typing import Any

from celery import Task
from celery.worker import state

from celery_orphans.exceptions import ExecutionForfeit

logger = logging.getLogger(__name__)

# Request attribute, set by the worker's main process when it admits a delivery: the generation of the
# worker boot that admitted it. Each forfeit starts a new generation.
GENERATION = "celery_orphans_generation"

# [0]: until when (time.monotonic(), the same clock in every process) executions of generation [1] hold.
# Created when the worker imports its tasks, before the pool forks, so every pool process shares it.
_validity = multiprocessing.RawArray(ctypes.c_double, 2)


def publish(generation: int, valid_until: float) -> None:
    """The heartbeat renewed the lease of ``generation``: its executions hold until ``valid_until``."""
    _validity[1] = generation
    _validity[0] = valid_until


def withdraw(generation: int) -> None:
    """Every execution of a generation older than ``generation`` is forfeit from now on."""
    # Until first: a reader takes the until, then the generation (see holds()).
    _validity[0] = 0.0
    _validity[1] = generation


def holds(generation: int) -> bool:
    """Whether an execution admitted under ``generation`` may still finish."""
    valid_until = _validity[0]
    return _validity[1] == generation and time.monotonic() < valid_until


def forfeit(request: Any) -> bool:
    """Whether the execution ``request`` describes was admitted under a generation that no longer holds."""
    generation = getattr(request, GENERATION, None)
    return isinstance(generation, int) and not holds(generation)


def refuse_if_forfeit(task: Task[Any, Any], what: str) -> None:
    """Raise ``ExecutionForfeit`` when the running execution of ``task`` is forfeit."""
    if forfeit(task.request):
        message = (
            f"{task.name}[{task.request.id}] was forfeit (its worker's lease was not renewed in time); "
            f"it may not {what}: the task is recovered from the ledger instead"
        )
        logger.warning("celery-orphans: %s", message)
        raise ExecutionForfeit(message)


def guard_task(task: Task[Any, Any]) -> None:
    """Make ``task``'s body and ``retry`` refuse to finish for a forfeit execution."""
    if task.__dict__.get("_celery_orphans_guarded"):
        return
    # On the instance, over whatever run is there (Celery's autoretry wraps it on the instance too).
    run, retry = task.run, task.retry

    @functools.wraps(run)
    def guarded_run(*args: Any, **kwargs: Any) -> Any:
        try:
            result = run(*args, **kwargs)
        except ExecutionForfeit:
            raise
        except BaseException as exc:
            if forfeit(task.request):
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
    """Mark the executions of ``generation`` and older forfeit; kill their pool processes where the pool
    runs each in a process of its own (prefork), or their green threads (gevent and eventlet: ``GreenletExit``
    at the next point where the body yields). Returns how many were marked.

    On the solo and threads pools the execution runs in a thread of this process, which cannot be stopped
    from outside: the body runs to its end, refused only what ``guard_task`` guards."""
    stopped = 0
    for request in list(state.active_requests):
        admitted = getattr(request, "_orphans_generation", None)
        if admitted is None or admitted > generation:
            continue
        request._orphans_forfeit = True
        stopped += 1
        pid = getattr(request, "worker_pid", None)
        if pid and pid != os.getpid() and pool is not None:  # solo and threads report this process
            try:
                pool.terminate_job(pid, signal.SIGKILL)
            except NotImplementedError:
                pass  # a pool that cannot stop one execution: its outcome is refused all the same
            except OSError as exc:
                logger.info(
                    "celery-orphans: the pool process of %s[%s] is gone: %s", request.name, request.id, exc
                )
    return stopped
