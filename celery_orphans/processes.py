"""Whether a worker's process still exists, as any process on the same machine can tell at once.

A worker's lease records its main process: the *machine* (the kernel's boot id and the process's pid
namespace, which together fix what a pid means), its pid, and the moment it started (in clock ticks
since the kernel booted, so a pid used again by a new process is not taken for the old one). Any process
that sees the same machine reads ``/proc/<pid>/stat``: no such process, a zombie, or one that started at
another moment, and the worker's main process has exited. Its pool processes exited with it: Celery's
prefork pool asks the kernel to kill each pool process when the main process dies (``PR_SET_PDEATHSIG``).

Only Linux answers; elsewhere, and wherever ``/proc`` is not this process's own, nothing is known here
and a worker is judged by its lease alone.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

PROC = "/proc"


@dataclass(frozen=True)
class Process:
    machine: str
    pid: int
    start: int

    def __str__(self) -> str:
        return f"{self.pid} {self.start}"

    @classmethod
    def parse(cls, machine: str | None, text: str) -> Process | None:
        if not machine:
            return None
        try:
            pid, start = text.split()
            return cls(machine, int(pid), int(start))
        except ValueError:
            return None


def this() -> Process | None:
    """This process, or ``None`` where no other process could tell when it exits."""
    machine = _machine()
    pid = os.getpid()
    stat = _stat(pid)
    if machine is None or stat is None:
        return None
    return Process(machine, pid, stat[1])


def exited(process: Process) -> bool:
    """Whether ``process`` has certainly exited; ``False`` when it lives or when this cannot be told here."""
    if not process.machine or process.machine != _machine():
        return False
    try:
        os.kill(process.pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # it exists, and belongs to another user
    stat = _stat(process.pid)
    if stat is None:  # hidden from this user (``hidepid``): it exists, which is all that is known
        return False
    state, start = stat
    return state in ("Z", "X") or start != process.start


@functools.lru_cache(maxsize=1)
def _machine_of(pid: int) -> str | None:
    try:
        with open(f"{PROC}/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
        namespace = os.readlink(f"{PROC}/self/ns/pid")
        # /proc must be this pid namespace's own: a /proc of another namespace numbers pids otherwise.
        with open(f"{PROC}/self/stat") as f:
            own_pid = int(f.read().split(" ", 1)[0])
    except (OSError, ValueError):
        return None
    return f"{boot_id}/{namespace}" if own_pid == pid else None


def _machine() -> str | None:
    return _machine_of(os.getpid())  # a forked child asks again: it may have entered a new namespace


def _stat(pid: int) -> tuple[str, int] | None:
    """The state letter and start time of ``pid``, or ``None`` if there is no such process."""
    try:
        with open(f"{PROC}/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    # The command name, in parentheses, may hold spaces and parentheses: the fields follow the last ')'.
    fields = text[text.rfind(")") + 2 :].split()
    try:
        return fields[0], int(fields[19])
    except (IndexError, ValueError):
        return None
