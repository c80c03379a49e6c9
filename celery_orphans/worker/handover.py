"""Each prefork pool process reads the validity from the main process's memory, however it was started.

A forked pool process inherits the memory ``forfeit.py`` made at import. A spawned one (Celery's
``worker_pool_start_method = "spawn"``, billiard's default on macOS) is a fresh interpreter that imports
the module again and gets a zeroed copy of its own, in which every execution would be forfeit. So just
before the pool makes each process (Celery's ``worker_before_create_process``), the pool's initializer is
wrapped: the memory travels with the process's start arguments (billiard passes its file on), and the
process adopts it before Celery's own initializer runs. Then the process's watchdog starts. (Celery's
``worker_process_init`` would not do: the solo pool sends it too, in the worker's main process.)

The same hook makes the main process see a pool process's death at once, as a forfeit needs: the task of
an execution whose process killed itself goes back (``request.py``'s ``on_failure``) only once the pool
has reaped that process. Celery watches each process's sentinel pipe and, when it turns readable, stops
watching it and reaps what has exited. But the kernel closes a dying process's files before it makes the
process waitable: a reap at that moment finds nothing, and nothing looks again until the pool's periodic
maintenance, up to 5 s later (meanwhile the task's row says ``STARTED``, its message is unacknowledged).
So when the sentinel fires and the process is not yet reaped, the pool looks again shortly, until it is
(``_reap_when_waitable``).
"""

from __future__ import annotations

import sys
from typing import Any

from kombu.transport import get_transport_cls

from celery_orphans.worker import forfeit, watchdog

# How soon the pool looks again for a process whose sentinel fired before it could be reaped, and for how
# long at most (then Celery's own maintenance, every 5 s, is left to find it).
REAP_RETRY_SECONDS = 0.01
REAP_RETRY_FOR_SECONDS = 2.0


def before_create_process(pool: Any) -> None:
    """Wrap ``pool``'s initializer (once) so that the process it makes adopts that memory, and have the
    pool reap a dead process as soon as it can be."""
    if getattr(pool, "_initializer", None) is initialize:
        return
    pool._initargs = (forfeit.shared(), pool._initializer, *pool._initargs)
    pool._initializer = initialize
    _reap_when_waitable(pool)


def _reap_when_waitable(pool: Any) -> None:
    """Make ``pool`` (Celery's ``AsynPool``) reap a process whose sentinel fired as soon as the kernel lets
    it, not at its next periodic maintenance."""
    on_exit = getattr(pool, "_event_process_exit", None)  # what the sentinel calls, looked up on the pool
    if on_exit is None or getattr(on_exit, "_celery_orphans_reaps", False):
        return

    def event_process_exit(hub: Any, proc: Any) -> None:
        on_exit(hub, proc)
        if not _exited(proc):  # its files are closed, but it is not waitable yet
            hub.call_later(REAP_RETRY_SECONDS, reap, hub, proc, REAP_RETRY_FOR_SECONDS)

    def reap(hub: Any, proc: Any, left: float) -> None:
        if _exited(proc):  # billiard's poll reaped it: the pool's maintenance now sees it exited
            pool.maintain_pool()
        elif left > 0:
            hub.call_later(REAP_RETRY_SECONDS, reap, hub, proc, left - REAP_RETRY_SECONDS)

    event_process_exit._celery_orphans_reaps = True  # type: ignore[attr-defined]
    pool._event_process_exit = event_process_exit


def _exited(proc: Any) -> bool:
    """Whether ``proc`` has exited and been reaped (billiard's ``exitcode`` polls ``waitpid``)."""
    try:
        return proc.exitcode is not None
    except ValueError:  # closed by the pool: long reaped
        return True


def initialize(validity: Any, initializer: Any, *initargs: Any) -> None:
    """A pool process's initializer: adopt the main process's validity, run Celery's own, then end this
    process's forfeit executions from now on."""
    forfeit.adopt(validity)
    if initializer is not None:
        initializer(*initargs)
    check = forfeit.PresenceCheck()
    watchdog.start(watchdog.Rules(forfeit.holds, check.pauses, forfeit.pausing, check.closed))


def unsupported(start_method: str, transport: str) -> str | None:
    """Why the validity could not reach the pool processes of a prefork worker started with
    ``start_method`` on the broker ``transport``; ``None`` if it can.

    A forked process inherits the memory. A spawned one is handed it by ``before_create_process``, which
    Celery calls from the pool it uses with its event loop; with a transport that has no event loop it
    uses billiard's plain pool, which never calls it."""
    if start_method == "fork" and sys.platform not in ("darwin", "win32"):  # billiard spawns there
        return None
    try:
        implements = getattr(get_transport_cls(transport), "implements", None)
    except (ImportError, KeyError, ValueError):
        return None  # a transport kombu cannot load fails the worker anyway, and says why
    if getattr(implements, "asynchronous", False):
        return None
    return (
        f"the prefork pool's processes are not forked (start method {start_method!r} on {sys.platform}) "
        f"and the broker transport {transport!r} has no event loop, so Celery starts them without "
        "telling celery-orphans: they could not read their worker's validity, and every recoverable "
        "execution would be refused its result"
    )
