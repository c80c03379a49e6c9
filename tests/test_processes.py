"""Telling that a worker's process exited, from another process on the same machine, with real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest

from celery_orphans import processes
from celery_orphans.processes import Process
from tests.helpers import exit_code_of


@pytest.fixture
def child() -> Iterator[subprocess.Popen[bytes]]:
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield process
    process.kill()
    process.wait()


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
