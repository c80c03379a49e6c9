"""Real ``celery worker`` subprocesses on the test project, started and killed like in production."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import celery

from tests.helpers import ROOT, wait_for

__all__ = ["ROOT", "Worker", "WorkerPool", "process_tree", "wait_for"]
# Most tests drive the sweeps themselves; the ones about a worker's own sweeps (at boot, and the watch's
# when a boot is gone) switch them back on, as the benchmarks do: they are on by default.
OWN_SWEEPS_OFF = {"CELERY_ORPHANS_BOOT_SWEEP": "false", "CELERY_ORPHANS_WATCH": "false"}
OWN_SWEEPS_ON = {"CELERY_ORPHANS_BOOT_SWEEP": "true", "CELERY_ORPHANS_WATCH": "true"}
PROJECT = ROOT / "testproject"
# What most tests start workers with: no gossip, mingle or event heartbeats, which only slow a boot down
# (mingle alone waits a second for neighbours). ``celery worker``'s own defaults are ``()``.
LEAN_FLAGS = ("--without-gossip", "--without-mingle", "--without-heartbeat")
# The prefork pool with spawned processes: Celery 5.7's --pool-start-method (earlier Celery has no spawn).
SPAWN_FLAGS = (*LEAN_FLAGS, "--pool-start-method", "spawn")
SPAWN = ["spawn"] if celery.VERSION >= (5, 7) else []


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (a worker's pool processes), from /proc; gone processes are skipped."""
    found, pending = [], [pid]
    while pending:
        current = pending.pop()
        try:
            for task in Path(f"/proc/{current}/task").iterdir():
                pending.extend(int(child) for child in (task / "children").read_text().split())
        except (FileNotFoundError, ProcessLookupError):
            continue
        found.append(current)
    return found


@dataclass
class Worker:
    """One worker process: its node name, log file and Popen handle."""

    name: str
    log_path: Path
    process: subprocess.Popen[bytes]
    started_at: float = field(default_factory=time.monotonic)

    @property
    def pid(self) -> int:
        return self.process.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def is_running(self) -> bool:
        return self.process.poll() is None

    def wait_ready(self, timeout: float = 30) -> None:
        def ready() -> bool:
            if not self.is_running():
                raise AssertionError(f"worker {self.name} exited early:\n{self.log()[-4000:]}")
            return " ready." in self.log()

        wait_for(ready, timeout, f"worker {self.name} to be ready")

    def send(self, signum: int) -> None:
        if self.is_running():
            os.killpg(self.process.pid, signum) if signum == signal.SIGKILL else self.process.send_signal(
                signum
            )

    def kill(self) -> None:
        """SIGKILL the worker and every process of its pool, as an OOM killer or node loss would."""
        self.send(signal.SIGKILL)
        self.process.wait(timeout=10)

    def stop(self, signum: int = signal.SIGTERM, timeout: float = 30) -> int:
        self.send(signum)
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise


class WorkerPool:
    """Starts workers for one test and makes sure none outlives it."""

    def __init__(self, tmp_path: Path, env: dict[str, str]) -> None:
        self.tmp_path = tmp_path
        self.env = env
        self.own_sweeps = OWN_SWEEPS_OFF  # what every worker it starts gets, unless ``env`` says otherwise
        self.workers: list[Worker] = []

    def start(
        self,
        name: str = "w1@test",
        *,
        pool: str = "prefork",
        concurrency: int = 1,
        queues: tuple[str, ...] = ("celery",),
        env: dict[str, str] | None = None,
        include: tuple[str, ...] = (),
        wait: bool = True,
        ready_timeout: float = 30,
        wrapper: tuple[str, ...] = (),
        flags: tuple[str, ...] = LEAN_FLAGS,
    ) -> Worker:
        """Start a worker; ``wrapper`` is a command it runs under (``unshare`` for a pid namespace),
        ``flags`` the options of ``celery worker`` it starts with besides its name, pool and queues."""
        log_path = self.tmp_path / f"{name.replace('@', '_')}-{len(self.workers)}.log"
        command = [
            *wrapper,
            sys.executable,
            "-m",
            "celery",
            "-A",
            "testproject",
            "worker",
            "-n",
            name,
            "-P",
            pool,
            "-c",
            str(concurrency),
            "-Q",
            ",".join(queues),
            *(["-I", ",".join(include)] if include else []),
            "--loglevel=INFO",
            *flags,
        ]
        with open(log_path, "ab") as log:
            process = subprocess.Popen(
                command,
                cwd=PROJECT,
                env={**self.env, **self.own_sweeps, **(env or {})},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        worker = Worker(name=name, log_path=log_path, process=process)
        self.workers.append(worker)
        if wait:
            worker.wait_ready(ready_timeout)
        return worker

    def close(self) -> None:
        for worker in self.workers:
            if worker.is_running():
                worker.kill()
            else:
                with contextlib.suppress(ProcessLookupError):  # pool children of a killed parent
                    os.killpg(worker.pid, signal.SIGKILL)

    def __iter__(self) -> Iterator[Worker]:
        return iter(self.workers)
