"""The chaos run's nemesis: faults that close nothing, struck at random while the tasks run.

A kill closes every connection of the worker (the chaos run's own ``--kill-every``). These do not:

- ``pause``: a worker and its pool stopped (``SIGSTOP``) for 1.5 leases, then continued (a frozen VM);
- ``freeze_main``: the worker's main process alone stopped for 1.5 leases while its pool processes run on
  (a main process hung in a blocking call);
- ``blackhole``: every packet between the worker and the ledger's Redis dropped for 1.5 leases, nothing
  closed (a partition, a dead middlebox);
- ``refuse_writes``: the ledger's Redis refuses writes for one to two leases, as a Redis over
  ``maxmemory`` with ``noeviction`` (``OOM``) or a replica left behind by a failover (``READONLY``) does;
- ``clock_step``: a worker's wall clock steps 5 to 30 s forward or back (NTP, an operator's ``date -s``).

Each worker reaches the ledger through a TCP proxy of its own (``tests.services.TcpProxy``) and, for clock
steps, runs under libfaketime (``tests.faults.SteppedClock``). At most one fault holds at a time, and never
on the last worker not faulted: the run must be able to finish.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

KINDS = ("pause", "freeze_main", "blackhole", "refuse_writes", "clock_step")


@dataclass(frozen=True)
class Fault:
    """One fault of the schedule: what, on which worker (``ledger`` for the ledger's Redis), from when
    until when (``time.time()``), and the processes whose executions it may rightly cost."""

    kind: str
    node: str
    at: float
    until: float
    detail: str = ""
    pids: frozenset[int] = frozenset()

    def what(self) -> str:
        detail = f" ({self.detail})" if self.detail else ""
        return f"{self.kind:<13} {self.node}{detail} for {self.until - self.at:.1f} s"

    def line(self, started: float) -> str:
        clock = time.strftime("%H:%M:%S", time.localtime(self.at))
        return f"{self.at - started:7.1f} s ({clock})  {self.what()}"


@dataclass
class Nemesis:
    """Strikes one fault of ``kinds`` at a time; ``heal()`` undoes whatever still holds."""

    kinds: tuple[str, ...]
    lease: float
    ledger: Any  # tests.services.RedisServer: the ledger's own Redis
    workdir: Path
    rng: random.Random
    say: Callable[[str], None]
    schedule: list[Fault] = field(default_factory=list)
    proxies: dict[str, Any] = field(default_factory=dict)  # node -> tests.services.TcpProxy
    clocks: dict[str, Any] = field(default_factory=dict)  # node -> tests.faults.SteppedClock
    _undo: list[tuple[threading.Timer, Callable[[], None]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        unknown = set(self.kinds) - set(KINDS)
        if unknown:
            raise ValueError(f"no such fault: {', '.join(sorted(unknown))} (known: {', '.join(KINDS)})")

    def worker_env(self, node: str, base: dict[str, str]) -> dict[str, str]:
        """The environment of a worker (re)started as ``node``: its own path to the ledger and clock."""
        from tests.faults import SteppedClock
        from tests.services import TcpProxy

        old = self.proxies.pop(node, None)
        if old is not None:
            old.close()
        proxy = self.proxies[node] = TcpProxy(self.ledger.port)
        env = {"CELERY_ORPHANS_REDIS_URL": proxy.url()}
        if "clock_step" in self.kinds:
            clock = self.clocks[node] = SteppedClock(self.workdir / f"clock-{node}-{time.time_ns()}")
            env.update(clock.env())
            env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], base.get("PYTHONPATH", "")])
        return env

    def holding(self) -> list[Fault]:
        now = time.time()
        return [f for f in self.schedule if f.at <= now < f.until]

    def faulted(self) -> set[str]:
        """Workers a fault holds now (every worker while the ledger refuses writes)."""
        return {f.node for f in self.holding()}

    def strike(self, workers: list[Any], pids_of: Callable[[int], set[int]]) -> Fault | None:
        """Strike a fault at random on one of ``workers`` (running, none faulted), if none holds now."""
        if self.holding() or len(workers) < 2:
            return None
        kind = self.rng.choice(self.kinds)
        victim = self.rng.choice(workers)
        group = frozenset(pids_of(victim.pid))
        everyone = frozenset(pid for w in workers for pid in pids_of(w.pid))
        fault = getattr(self, f"_{kind}")(victim, group, everyone)
        self.schedule.append(fault)
        self.say(f"nemesis: {fault.what()}")
        return fault

    def heal(self) -> None:
        """Undo every fault that still holds, at once."""
        for timer, undo in self._undo:
            if timer.is_alive():
                timer.cancel()
                undo()
        self._undo.clear()

    def close(self) -> None:
        self.heal()
        for proxy in self.proxies.values():
            proxy.close()

    def lines(self, started: float) -> list[str]:
        return [fault.line(started) for fault in self.schedule]

    # --- the faults ---------------------------------------------------------------------------------

    def _later(self, seconds: float, undo: Callable[[], None]) -> None:
        timer = threading.Timer(seconds, undo)
        timer.daemon = True
        self._undo.append((timer, undo))
        timer.start()

    def _pause(self, victim: Any, group: frozenset[int], everyone: frozenset[int]) -> Fault:
        seconds = 1.5 * self.lease
        _signal_group(victim.pid, signal.SIGSTOP)
        self._later(seconds, lambda: _signal_group(victim.pid, signal.SIGCONT))
        return Fault("pause", victim.name, time.time(), time.time() + seconds, pids=group)

    def _freeze_main(self, victim: Any, group: frozenset[int], everyone: frozenset[int]) -> Fault:
        seconds = 1.5 * self.lease
        _signal(victim.pid, signal.SIGSTOP)
        self._later(seconds, lambda: _signal(victim.pid, signal.SIGCONT))
        return Fault("freeze_main", victim.name, time.time(), time.time() + seconds, pids=group)

    def _blackhole(self, victim: Any, group: frozenset[int], everyone: frozenset[int]) -> Fault:
        seconds = 1.5 * self.lease
        proxy = self.proxies[victim.name]
        proxy.blackhole()
        self._later(seconds, proxy.restore)
        return Fault("blackhole", victim.name, time.time(), time.time() + seconds, pids=group)

    def _refuse_writes(self, victim: Any, group: frozenset[int], everyone: frozenset[int]) -> Fault:
        seconds = self.rng.uniform(1.0, 2.0) * self.lease
        how = self.rng.choice(("oom", "readonly"))
        self.ledger.refuse_writes(how)
        self._later(seconds, self.ledger.accept_writes)
        return Fault("refuse_writes", "ledger", time.time(), time.time() + seconds, how, everyone)

    def _clock_step(self, victim: Any, group: frozenset[int], everyone: frozenset[int]) -> Fault:
        step = self.rng.choice((-1, 1)) * self.rng.uniform(5.0, 30.0)
        self.clocks[victim.name].step_wall(step)
        # A step is instantaneous; it holds for a lease so that no other fault overlaps its effects.
        return Fault("clock_step", victim.name, time.time(), time.time() + self.lease, f"{step:+.1f} s")


def _signal(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signum)


def _signal_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signum)
