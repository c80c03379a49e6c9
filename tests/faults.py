"""Faults for the never-twice tests, and the checker of what a task's executions actually did.

A guarantee is tested against faults that close connections and against faults that do not, and judged by
what happened rather than by final states:

- the network: ``tests.services.TcpProxy`` (pass, close, close the server's end alone, blackhole, delay,
  one way), on every connection or only on those that name themselves (``only``);
- a Redis that refuses writes while it answers reads: ``RedisServer.refuse_writes()``;
- a worker whose clocks are stepped: ``SteppedClock``, libfaketime for its wall clock, and a small shim
  (``tests/clock_shim``) for its monotonic and boot-time clocks (a suspended host, a paused VM);
- a worker's main process stopped alone while its pool processes run on: ``main_frozen``;
- the overlap checker: ``demoapp.tick`` records timestamped side effects, ``overlap`` says whether a stale
  execution acted after a later one had started.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.helpers import ROOT, started_on, wait_for
from tests.workers import OWN_SWEEPS_ON, Worker, process_tree

# --- a worker's clocks ---------------------------------------------------------------------------


def _libfaketime() -> Path:
    """Debian's faketime package (the build for threaded programs); FAKETIME_LIBRARY names another."""
    given = os.environ.get("FAKETIME_LIBRARY")
    if given:
        return Path(given)
    found = sorted(Path("/usr/lib").glob("*/faketime/libfaketimeMT.so.1"))
    return found[0] if found else Path("/usr/lib/faketime/libfaketimeMT.so.1")


LIBFAKETIME = _libfaketime()
SHIM = ROOT / "tests" / "clock_shim"


class SteppedClock:
    """The clocks of the workers started with ``env()``, stepped by the test while they run.

    The wall clock (``time.time()``, ``datetime.now()``, log lines: everything in the process) is
    libfaketime's, read from a file at every call, so a step takes effect at once. The monotonic clock is
    left to the kernel by libfaketime: Debian 12's libfaketime 0.9.10 does not intercept
    ``sem_clockwait``, so a faked CLOCK_MONOTONIC hangs every timed wait of Python 3.11 and later. The
    shim in ``tests/clock_shim`` steps what Python reads instead: ``time.monotonic()`` and
    ``time.clock_gettime`` of CLOCK_MONOTONIC and of CLOCK_BOOTTIME, which time the worker's forfeit; the
    waits of its threads keep the kernel's clock.
    """

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.wall_file = directory / "faketime.rc"
        self.monotonic_file = directory / "monotonic.offset"
        self.boottime_file = directory / "boottime.offset"
        self.wall_offset = 0.0
        self.monotonic_offset = 0.0
        self.boottime_offset = 0.0
        self._write()

    @staticmethod
    def available() -> bool:
        return LIBFAKETIME.exists()

    def env(self) -> dict[str, str]:
        """Environment for a worker whose clocks this steps."""
        if not self.available():
            raise RuntimeError(
                f"{LIBFAKETIME} is missing: apt-get install faketime (tests/setup-env.sh does)"
            )
        return {
            "LD_PRELOAD": str(LIBFAKETIME),
            "FAKETIME_TIMESTAMP_FILE": str(self.wall_file),
            "FAKETIME_NO_CACHE": "1",  # read the file at every call: a step shows at once
            "FAKETIME_DONT_FAKE_MONOTONIC": "1",
            "FAKETIME_DONT_RESET": "1",  # pool processes keep the worker's clock
            "CLOCK_SHIM_MONOTONIC_FILE": str(self.monotonic_file),
            "CLOCK_SHIM_BOOTTIME_FILE": str(self.boottime_file),
            "PYTHONPATH": os.pathsep.join([str(SHIM), str(ROOT)]),
        }

    def step_wall(self, seconds: float) -> None:
        """Step the wall clock by ``seconds`` (forward or back), as NTP or an operator's ``date -s`` does."""
        self.wall_offset += seconds
        self._write()

    def step_monotonic(self, seconds: float) -> None:
        """Step the monotonic clock; ``-d`` after a ``d`` s stop is a suspend: it did not advance."""
        self.monotonic_offset += seconds
        self._write()

    def step_boottime(self, seconds: float) -> None:
        """Step CLOCK_BOOTTIME, which counts a suspend; ``-d`` with the monotonic clock's after a ``d`` s
        stop is a paused virtual machine: no clock of the guest advanced."""
        self.boottime_offset += seconds
        self._write()

    def _write(self) -> None:
        # Each file is replaced whole: a reader never sees half a number.
        for path, text in (
            (self.wall_file, f"{self.wall_offset:+.3f}\n"),
            (self.monotonic_file, f"{self.monotonic_offset:.6f}\n"),
            (self.boottime_file, f"{self.boottime_offset:.6f}\n"),
        ):
            part = path.with_suffix(".part")
            part.write_text(text)
            part.replace(path)


def faketime_installed() -> bool:
    return SteppedClock.available() and shutil.which("faketime") is not None


# --- a worker's main process, stopped alone --------------------------------------------------------


def pool_processes(worker: Worker) -> list[int]:
    """The pids of the worker's pool processes (its descendants)."""
    return [pid for pid in process_tree(worker.pid) if pid != worker.pid]


@contextlib.contextmanager
def main_frozen(worker: Worker) -> Iterator[float]:
    """SIGSTOP the worker's main process alone, as a main process hung in a blocking call: its pool
    processes run on. Yields the moment it stopped (``time.time()``); SIGCONT on leaving."""
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        yield time.time()
    finally:
        os.kill(worker.pid, signal.SIGCONT)


def freeze(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)


def thaw(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


# --- the overlap checker ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Effect:
    """One side effect of ``demoapp.tick``: which execution made it, where, and when (Redis's clock)."""

    execution: str
    pid: int
    seq: int
    local_time: float  # the worker's own clock, possibly stepped
    at: float  # the Redis server's clock, one for every worker

    @classmethod
    def parse(cls, line: str) -> Effect:
        execution, pid, seq, local_time, at = line.split(":")
        return cls(execution, int(pid), int(seq), float(local_time), float(at))


@dataclass(frozen=True)
class Overlap:
    """What the executions of one task id did once a later execution had started."""

    executions: list[str]  # in the order they started
    started: dict[str, float]  # execution -> its first side effect
    stale: list[Effect]  # side effects of an execution made after a later one had started

    @property
    def count(self) -> int:
        return len(self.stale)

    @property
    def window(self) -> float:
        """How long, in seconds, a stale execution went on acting after the next one started."""
        return max((e.at - self._next_start(e) for e in self.stale), default=0.0)

    def _next_start(self, effect: Effect) -> float:
        later = self.executions[self.executions.index(effect.execution) + 1 :]
        return min(self.started[x] for x in later)

    def __str__(self) -> str:
        return (
            f"{len(self.executions)} executions, {self.count} side effects of a stale execution after a "
            f"later one started, over {self.window:.2f} s"
        )


def effects(task_id: str) -> list[Effect]:
    from demoapp.tasks import effects as recorded

    return [Effect.parse(line) for line in recorded(task_id)]


def overlap(task_id: str) -> Overlap:
    """Which side effects of ``task_id``'s executions came after a later execution had started."""
    found = effects(task_id)
    started: dict[str, float] = {}
    for e in found:
        started.setdefault(e.execution, e.at)
    order = sorted(started, key=started.__getitem__)
    stale = [e for e in found if any(started[x] <= e.at for x in order[order.index(e.execution) + 1 :])]
    return Overlap(order, started, stale)


def longest_pause(task_id: str) -> float:
    """The longest time, in seconds, between two side effects in a row of one execution of ``task_id``."""
    by_execution: dict[str, list[float]] = {}
    for e in effects(task_id):
        by_execution.setdefault(e.execution, []).append(e.at)
    return max((b - a for ats in by_execution.values() for a, b in itertools.pairwise(ats)), default=0.0)


def assert_no_overlap(task_id: str, tolerance: float = 0.0) -> Overlap:
    """Fail if a stale execution of ``task_id`` acted more than ``tolerance`` s after a later one started."""
    found = overlap(task_id)
    assert found.window <= tolerance and (tolerance or not found.stale), f"{task_id}: {found}"
    return found


def quiet(
    task_id: str,
    seconds: float = 1.5,
    timeout: float = 60,
    *,
    stale: bool = False,
    execution: str | None = None,
) -> Overlap:
    """Wait until no execution of ``task_id`` (with ``stale``, none but the last to start; with ``execution``,
    that one alone) has acted for ``seconds``: each ended or was stopped."""

    def still() -> bool:
        found = overlap(task_id)
        watched = [execution] if execution else found.executions[:-1] if stale else found.executions
        last = [e.at for e in effects(task_id) if e.execution in watched]
        return bool(last) and time.time() - max(last) >= seconds

    wait_for(still, timeout, f"the executions of {task_id} to stop acting", interval=0.1)
    return overlap(task_id)


def seen_in_log(worker: Worker, text: str, timeout: float) -> float:
    """Wait until ``text`` is in the worker's log; the moment it was first seen (``time.time()``)."""
    wait_for(lambda: text in worker.log(), timeout, f"{text!r} in the log of {worker.name}", interval=0.05)
    return time.time()


def report(fault: str, **measured: float | int | str) -> str:
    """Print what a fault test measured, and append it to the JSON-lines file FAULTS_REPORT names."""
    numbers = {k: round(v, 2) if isinstance(v, float) else v for k, v in measured.items()}
    line = f"{fault}: " + ", ".join(f"{k}={v}" for k, v in numbers.items())
    print(line)
    path = os.environ.get("FAULTS_REPORT")
    if path:
        with open(path, "a") as out:
            out.write(json.dumps({"fault": fault, **numbers}) + "\n")
    return line


def report_no_overlap(fault: str, task_id: str, found: Overlap, **measured: float | int | str) -> None:
    """``report`` what a fault test measured, with the stale effects ``quiet`` found, then
    ``assert_no_overlap``."""
    report(fault, **measured, stale_effects=found.count, overlap_seconds=found.window)
    assert_no_overlap(task_id)


# Renewals 2 s apart and a 10 s lease, as by default.
DEFAULT_TIMINGS = {"CELERY_ORPHANS_HEARTBEAT_SECONDS": "2", "CELERY_ORPHANS_LEASE_SECONDS": "10"}


def tick_beside_a_watcher(
    workers: Any,
    name: str,
    seconds: float,
    *,
    pool: str = "prefork",
    env: dict[str, str] | None = None,
    shared: dict[str, str] | None = None,
) -> tuple[Worker, Any]:
    """A ``demoapp.tick`` running on a live worker of its own queue (``env`` its own settings), with a
    watcher up that takes the queue once it is running; both with presence on and the default timings
    (and ``shared``), each one's presence recorded by two of its renewals."""
    from celery import current_app
    from demoapp.tasks import tick

    workers.own_sweeps = {**OWN_SWEEPS_ON, **DEFAULT_TIMINGS, **(shared or {})}
    live = workers.start(f"live-{name}@test", queues=(name,), pool=pool, env=env)
    workers.start(f"watcher-{name}@test")
    result = tick.apply_async((seconds,), {"every": 0.25}, queue=name)
    started_on(result.id, live.name)
    current_app.control.add_consumer(name, destination=[f"watcher-{name}@test"], reply=True, timeout=5)
    time.sleep(4)
    return live, result
