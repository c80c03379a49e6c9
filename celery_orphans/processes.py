"""Whether a worker's process still exists, as any process on the same machine can tell at once.

A worker's lease records its main process: the *machine* (the kernel's boot id and the process's pid
namespace, which together fix what a pid means), its pid, and the moment it started (in clock ticks
since the kernel booted, so a pid used again by a new process is not taken for the old one). Any process
that sees the same machine reads ``/proc/<pid>/stat``: no such process, a zombie, or one that started at
another moment, and the worker's main process has exited. Its pool processes exited with it: Celery's
prefork pool asks the kernel to kill each pool process when the main process dies (``PR_SET_PDEATHSIG``).

A process can also be *followed* (``Exits``): a pidfd on it becomes readable the instant it exits
(Linux 5.3 and later; 0.56 ms after a SIGKILL on this project's machine), so a neighbour's death is known
without asking again and again.

Only Linux answers; elsewhere, and wherever ``/proc`` is not this process's own, nothing is known here
and a worker is judged by its lease alone.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import select
import threading
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

from celery_orphans import logs

PROC = "/proc"
logger = logs.get(__name__)


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


def pidfd(process: Process) -> int | None:
    """A descriptor that becomes readable the instant ``process`` exits (a pidfd, Linux 5.3 and later),
    or ``None`` where none can be had: another machine, another system or kernel, or the process gone."""
    if not hasattr(os, "pidfd_open") or process.machine != _machine():
        return None
    try:
        fd = os.pidfd_open(process.pid)
    except OSError:  # no such process, or no pidfd here (ENOSYS, EPERM under a sandbox)
        return None
    # The pid may have been used again before it was opened: the descriptor must be this very process's.
    stat = _stat(process.pid)
    if stat is None or stat[0] in ("Z", "X") or stat[1] != process.start:
        os.close(fd)
        return None
    return fd


Key = TypeVar("Key", bound=Hashable)


class Exits(Generic[Key]):
    """Follows processes of this machine and calls ``on_exit(key)``, from a thread of its own, the instant
    one of them exits: the kernel says so through a pidfd, nothing is polled. A process that cannot be
    followed so (see ``pidfd``) is left to whoever checks ``exited`` from time to time."""

    def __init__(self, on_exit: Callable[[Key], None], limit: int = 256) -> None:
        self.on_exit = on_exit
        self.limit = limit  # descriptors held at most: a process has a bounded number of them
        self._lock = threading.Lock()
        self._wanted: dict[Key, Process] = {}
        self._wake: tuple[int, int] | None = None  # a pipe: a byte in it makes the thread look again
        self._thread: threading.Thread | None = None

    def follow(self, wanted: Mapping[Key, Process]) -> None:
        """Follow these processes from now on, and no others."""
        if not hasattr(os, "pidfd_open"):
            return
        chosen = dict(itertools.islice(wanted.items(), self.limit))
        with self._lock:
            if chosen == self._wanted and self._thread is not None:
                return  # as every renewal of a quiet machine finds it
            self._wanted = chosen
            if self._thread is None:
                self._wake = os.pipe()
                os.set_blocking(self._wake[1], False)
                self._thread = threading.Thread(target=self._run, name="celery-orphans-exits", daemon=True)
                self._thread.start()
                return
        assert self._wake is not None
        # A full pipe holds wake-ups the thread has yet to read: it will look anyway.
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake[1], b".")

    def _run(self) -> None:
        assert self._wake is not None
        wake = self._wake[0]
        held: dict[Key, int] = {}  # only this thread opens and closes the descriptors
        while True:
            with self._lock:
                wanted = dict(self._wanted)
            for key in [k for k in held if k not in wanted]:
                os.close(held.pop(key))
            for key in [k for k in wanted if k not in held]:
                fd = pidfd(wanted[key])
                if fd is not None:
                    held[key] = fd
            poller = select.poll()
            poller.register(wake, select.POLLIN)
            keys = {fd: key for key, fd in held.items()}
            for fd in keys:
                poller.register(fd, select.POLLIN)
            ready = {fd for fd, _ in poller.poll()}
            if wake in ready:  # what is followed changed: a process no longer followed is not reported
                os.read(wake, 4096)
                continue
            for fd in ready:
                key = keys[fd]
                os.close(held.pop(key))
                with self._lock:
                    self._wanted.pop(key, None)
                self._exited(key)

    def _exited(self, key: Key) -> None:
        try:
            self.on_exit(key)
        except Exception:  # the thread must outlive one failed report: log it, with its traceback
            logger.exception("reporting the exit of %s failed", key)


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


def stopped(pid: int) -> bool:
    """Whether ``pid`` is a process stopped by a signal (``SIGSTOP``) here; ``False`` where ``/proc`` cannot
    say."""
    stat = _stat(pid)
    return stat is not None and stat[0] == "T"


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
