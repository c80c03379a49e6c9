"""Each prefork pool process reads the validity from the main process's memory, however it was started.

A forked pool process inherits the memory ``forfeit.py`` made at import. A spawned one (Celery's
``worker_pool_start_method = "spawn"``, billiard's default on macOS) is a fresh interpreter that imports
the module again and gets a zeroed copy of its own, in which every execution would be forfeit. So just
before the pool makes each process (Celery's ``worker_before_create_process``), the pool's initializer is
wrapped: the memory travels with the process's start arguments (billiard passes its file on), and the
process adopts it before Celery's own initializer runs. Then the process's watchdog starts. (Celery's
``worker_process_init`` would not do: the solo pool sends it too, in the worker's main process.)
"""

from __future__ import annotations

import sys
from typing import Any

from kombu.transport import get_transport_cls

from celery_orphans.worker import forfeit, watchdog


def before_create_process(pool: Any) -> None:
    """Wrap ``pool``'s initializer (once) so that the process it makes adopts that memory."""
    if getattr(pool, "_initializer", None) is initialize:
        return
    pool._initargs = (forfeit.shared(), pool._initializer, *pool._initargs)
    pool._initializer = initialize


def initialize(validity: Any, initializer: Any, *initargs: Any) -> None:
    """A pool process's initializer: adopt the main process's validity, run Celery's own, then end this
    process's forfeit executions from now on."""
    forfeit.adopt(validity)
    if initializer is not None:
        initializer(*initargs)
    watchdog.start(forfeit.holds)


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
