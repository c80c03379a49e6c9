"""Loaded at start-up by a worker whose clocks a test steps (``tests.faults.SteppedClock``).

- ``time.monotonic()``, and ``time.clock_gettime(CLOCK_MONOTONIC)``, read the kernel's clock plus the
  offset in ``CLOCK_SHIM_MONOTONIC_FILE``; ``time.clock_gettime(CLOCK_BOOTTIME)`` the kernel's plus the
  offset in ``CLOCK_SHIM_BOOTTIME_FILE``. A test that stops a worker for ``d`` seconds and steps the
  monotonic offset by ``-d`` before it resumes gives it the clocks of a host that was suspended:
  CLOCK_MONOTONIC did not advance, CLOCK_BOOTTIME did. Stepping both by ``-d`` gives it those of a paused
  virtual machine, whose clocks all stood still.
- Under libfaketime 0.9.10 (Debian 12) with CLOCK_MONOTONIC left alone, ``clock_nanosleep`` with an
  absolute monotonic deadline fails with EINVAL, and Python 3.11 and later sleep that way: ``time.sleep``
  then sleeps through ``select`` instead, which libfaketime passes through.
"""

from __future__ import annotations

import os
import select
import time

_FILES = {
    "monotonic": os.environ.get("CLOCK_SHIM_MONOTONIC_FILE"),
    "boottime": os.environ.get("CLOCK_SHIM_BOOTTIME_FILE"),
}
_real_monotonic = time.monotonic
_real_monotonic_ns = time.monotonic_ns
_real_clock_gettime = time.clock_gettime
_real_clock_gettime_ns = time.clock_gettime_ns
_cache: dict[str, tuple[int, float]] = {}  # clock -> its file's mtime, its offset


def _offset(clock: str) -> float:
    path = _FILES[clock]
    if not path:
        return 0.0
    changed, offset = _cache.get(clock, (-1, 0.0))
    try:
        mtime = os.stat(path).st_mtime_ns
        if mtime != changed:
            with open(path) as f:
                offset = float(f.read().strip() or 0)
            _cache[clock] = (mtime, offset)
    except (OSError, ValueError):
        pass
    return offset


_STEPPED = {time.CLOCK_MONOTONIC: "monotonic"}
if hasattr(time, "CLOCK_BOOTTIME"):
    _STEPPED[time.CLOCK_BOOTTIME] = "boottime"


def monotonic() -> float:
    return _real_monotonic() + _offset("monotonic")


def monotonic_ns() -> int:
    return _real_monotonic_ns() + int(_offset("monotonic") * 1e9)


def clock_gettime(clk_id: int) -> float:
    stepped = _STEPPED.get(clk_id)
    return _real_clock_gettime(clk_id) + (_offset(stepped) if stepped else 0.0)


def clock_gettime_ns(clk_id: int) -> int:
    stepped = _STEPPED.get(clk_id)
    return _real_clock_gettime_ns(clk_id) + (int(_offset(stepped) * 1e9) if stepped else 0)


def _sleep(seconds: float) -> None:
    deadline = _real_monotonic() + seconds
    while (left := deadline - _real_monotonic()) > 0:
        select.select([], [], [], left)


if any(_FILES.values()):
    time.monotonic = monotonic
    time.monotonic_ns = monotonic_ns
    time.clock_gettime = clock_gettime
    time.clock_gettime_ns = clock_gettime_ns
try:
    time.sleep(0.000001)
except OSError:
    time.sleep = _sleep
