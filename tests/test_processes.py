"""Telling that a worker's process exited, from another process on the same machine, with real processes."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from celery_orphans import processes
from celery_orphans.processes import Process
from tests.helpers import exit_code_of, wait_for


def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield process
    process.kill()
    process.wait()


child = pytest.fixture(sleeper, name="child")
second_child = pytest.fixture(sleeper, name="second_child")


def process_of(pid: int) -> Process:
    here = processes.this()
    assert here is not None
    with open(f"/proc/{pid}/stat") as f:
        start = int(f.read().rsplit(")", 1)[1].split()[19])
    return Process(here.machine, pid, start)


def test_this_process_is_its_pid_and_start_on_this_machine() -> None:
    here = processes.this()

    assert here is not None and here.pid == os.getpid()
    assert here == process_of(os.getpid())
    assert processes.this() == here
    assert not processes.exited(here)


def test_a_forked_child_is_another_process_on_the_same_machine() -> None:
    here = processes.this()
    assert here is not None
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        child = processes.this()
        os.write(write, str(child).encode() if child and child.machine == here.machine else b"")
        os._exit(0)
    os.close(write)
    assert exit_code_of(pid) == 0
    reported = os.read(read, 100).decode()
    os.close(read)

    assert reported.split()[0] == str(pid) and reported != str(here)


def test_a_live_process_has_not_exited(child: subprocess.Popen[bytes]) -> None:
    assert not processes.exited(process_of(child.pid))


def test_a_killed_process_has_exited_before_and_after_its_parent_reaps_it(
    child: subprocess.Popen[bytes],
) -> None:
    process = process_of(child.pid)
    child.send_signal(signal.SIGKILL)
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # dead, not yet reaped: a zombie

    assert processes.exited(process)
    child.wait()
    assert processes.exited(process)


def test_a_pid_used_again_by_a_process_that_started_at_another_moment_is_not_the_same_process(
    child: subprocess.Popen[bytes],
) -> None:
    process = process_of(child.pid)

    assert processes.exited(Process(process.machine, process.pid, process.start + 1))


@pytest.mark.parametrize(
    "machine",
    ["another-kernel/pid:[4026531836]", "", "another-namespace"],
    ids=["kernel", "none", "namespace"],
)
def test_a_process_of_another_machine_is_never_taken_for_exited(machine: str) -> None:
    gone = 2**22 + 1  # above the kernel's largest pid: no process here has it

    assert not processes.exited(Process(machine, gone, 1))


def test_a_process_is_read_from_what_a_lease_records() -> None:
    assert Process.parse("m", "12 345") == Process("m", 12, 345)
    assert str(Process("m", 12, 345)) == "12 345"
    assert Process.parse(None, "12 345") is None
    assert Process.parse("m", "12") is None
    assert Process.parse("m", "twelve 345") is None


# --- following a process: the kernel says when it exits ----------------------------------------------


class Reports:
    """What an ``Exits`` reported, with when."""

    def __init__(self) -> None:
        self.keys: list[str] = []
        self.at: list[float] = []
        self.one = threading.Event()

    def __call__(self, key: str) -> None:
        self.at.append(time.monotonic())
        self.keys.append(key)
        self.one.set()


def test_a_followed_process_is_reported_the_moment_it_is_killed(child: subprocess.Popen[bytes]) -> None:
    reports = Reports()
    exits: processes.Exits[str] = processes.Exits(reports)
    exits.follow({"child": process_of(child.pid)})
    wait_for(lambda: child.pid in _followed_pids(), what="the pidfd to be opened")

    child.send_signal(signal.SIGKILL)
    killed = time.monotonic()

    assert reports.one.wait(10)
    assert reports.keys == ["child"]
    assert reports.at[0] - killed < 0.5  # the renewal's own check would see it a heartbeat (2 s) later


def test_a_process_no_longer_followed_is_not_reported(
    child: subprocess.Popen[bytes], second_child: subprocess.Popen[bytes]
) -> None:
    reports = Reports()
    exits: processes.Exits[str] = processes.Exits(reports)
    exits.follow({"first": process_of(child.pid)})
    exits.follow({"second": process_of(second_child.pid)})
    # A process that exits before its thread opens its pidfd cannot be followed (pidfd() refuses a zombie):
    # kill them only once it follows the second alone.
    wait_for(lambda: _followed_pids() == {second_child.pid}, what="the thread to follow the second alone")

    child.send_signal(signal.SIGKILL)
    second_child.send_signal(signal.SIGKILL)

    assert reports.one.wait(10)
    assert reports.keys == ["second"]


def test_a_pid_used_again_by_another_process_is_not_followed(child: subprocess.Popen[bytes]) -> None:
    process = process_of(child.pid)

    assert processes.pidfd(Process(process.machine, process.pid, process.start + 1)) is None


def test_a_process_of_another_machine_or_gone_is_not_followed(child: subprocess.Popen[bytes]) -> None:
    process = process_of(child.pid)
    child.kill()
    child.wait()

    assert processes.pidfd(Process("another-kernel/pid:[4026531836]", os.getpid(), 1)) is None
    assert processes.pidfd(process) is None


def _followed_pids() -> set[int]:
    """The pids this process holds a pidfd of (the kernel names each in the descriptor's fdinfo)."""
    pids = set()
    for fd in Path("/proc/self/fd").iterdir():
        if _readlink(fd) != "anon_inode:[pidfd]":
            continue
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/self/fdinfo/{fd.name}").read_text().splitlines():
                if line.startswith("Pid:"):
                    pids.add(int(line.split()[1]))
    return pids


def _readlink(path: Path) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""
