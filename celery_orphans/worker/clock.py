"""The clock a worker's forfeit is timed by, the same in every process of the machine.

CLOCK_BOOTTIME counts the time a host spends suspended; CLOCK_MONOTONIC (``time.monotonic()``) does not,
so a worker resumed after a suspend longer than its lease would take its executions to hold while the
sweep, whose lease in Redis lapsed meanwhile, recovers them. Where there is no CLOCK_BOOTTIME (macOS), the
monotonic clock is the best there is.
"""

from __future__ import annotations

import time

_BOOTTIME: int | None = getattr(time, "CLOCK_BOOTTIME", None)


def now() -> float:
    """Seconds on this clock: only differences between two readings mean anything."""
    # time.clock_gettime looked up at each call, so a test's start-up shim can step it.
    if _BOOTTIME is None:
        return time.monotonic()
    return time.clock_gettime(_BOOTTIME)
