"""Chaos (R1): workers SIGKILLed at random under a stream of recoverable tasks; every task must run once.

Three ``celery worker -P prefork -c 2`` processes consume ``--tasks`` recoverable tasks of 0.5 to 3 s.
Each execution records its start and its finish (with its pool process id, node and recovery attempt) in
Redis. A killer SIGKILLs a random worker's whole process group every ``--kill-every`` seconds (with
jitter) and starts a replacement at once: half the time under the same node name (its boot sweep finds
what the dead boot left), otherwise under a new name (only the regular sweep can prove the old one gone).
The regular sweep runs as in production: Beat's schedule through a ``celery beat`` process, its task
routed to a queue of its own that the workers also consume (``--sweeper beat``, the default), or a loop in
this process every ``CELERY_ORPHANS_SWEEP_INTERVAL_SECONDS`` (``--sweeper loop``).

At the end it prints:

- how many tasks ended SUCCESS (must be all of them);
- executions finished per task (must be exactly 1 for every task): an execution finished when its
  body ended and its outcome is the one stored; a body that ended in a process killed before it could
  store the result did not finish the task, which rightly runs again;
- extra starts, and how many are explained by a kill of that very execution (its pool process was in
  the process group killed after it began and before its result was stored); unexplained extra starts
  must be 0;
- stale-copy executions after recovery: a copy of a task that began although a later recovery attempt
  of it had already been sent (must be 0).

    python benchmarks/chaos.py --tasks 1000 --kill-every 5
    python benchmarks/chaos.py --tasks 1000 --kill-every 5 --broker amqp

Services: PostgreSQL (database ``chaos_orphans_<broker>``, created and migrated if missing: a run on
each broker may run side by side, and the sweeps of one never see the other's rows), a Redis server of its
own, and for ``--broker amqp`` a RabbitMQ vhost of its own (``celery-orphans-chaos``, made and deleted by
the run). Override with ``CHAOS_DATABASE_URL``, ``CHAOS_REDIS_URL`` (a Redis database the run empties) and
``CHAOS_AMQP_URL``. Each run consumes a queue and uses node names of its own (``chaos-<run id>``,
``chaos-w0-<run id>@bench``), so it never meets another run on the same broker.

This module is also what the workers import (``-I benchmarks.chaos``) for the task ``chaos.work``, so its
top level only defines that task; everything else runs from ``main()``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from celery import shared_task
from celery.signals import task_success

from celery_orphans import recoverable
from celery_orphans.signals import orphan_recovered

if TYPE_CHECKING:
    from benchmarks.nemesis import Nemesis

ROOT = Path(__file__).resolve().parent.parent
PROJECT = ROOT / "testproject"
TASK = "chaos.work"
RUNS_KEY = "chaos:runs:{}"
RECOVERIES_KEY = "chaos:recoveries:{}"
# An execution whose body finished but whose process was killed within this long after, before its
# result was stored, was lost to the kill: the task rightly runs again.
LOST_AFTER_FINISH_SECONDS = 5.0


_clients: dict[int, Any] = {}
# Each record is stamped by the Redis server's clock, one for every worker: a worker's own clock may be
# stepped by the nemesis.
STAMP = (
    "local t = redis.call('TIME') "
    "local at = t[1] .. '.' .. string.format('%06d', tonumber(t[2])) "
    "return redis.call('RPUSH', KEYS[1], ARGV[1] .. '|' .. at)"
)
EFFECT_EVERY = 0.25  # seconds between a body's side effects


def _runs_redis() -> Any:
    """This process's client for the run's records (a pool process makes its own)."""
    client = _clients.get(os.getpid())
    if client is None:
        import redis
        from django.conf import settings

        client = _clients[os.getpid()] = redis.Redis.from_url(settings.REDIS_URL)
    return client


def parse_record(raw: bytes) -> dict[str, Any]:
    body, at = raw.decode().rsplit("|", 1)
    return {**json.loads(body), "at": float(at)}


def _own_sweeps_on() -> dict[str, str]:
    from tests.workers import OWN_SWEEPS_ON

    return OWN_SWEEPS_ON


def _record(request: Any, event: str) -> None:
    meta = getattr(request, "celery_orphans", None)
    attempt = meta.get("attempt", 0) if isinstance(meta, dict) else 0
    record = {
        "event": event,
        "pid": os.getpid(),
        "node": request.hostname,
        "attempt": attempt,
        "execution": getattr(request, "chaos_execution", ""),
    }
    _runs_redis().eval(STAMP, 1, RUNS_KEY.format(request.id), json.dumps(record))


def _work(self: Any, seconds: float) -> dict[str, Any]:
    """Idempotent busy work: records its start, a side effect every quarter second, its finish.

    Its result names the process that ran it, so the run can tell which execution's outcome was stored.
    """
    self.request.chaos_execution = os.urandom(4).hex()
    _record(self.request, "start")
    end = time.monotonic() + seconds
    next_effect = time.monotonic()
    while (left := end - time.monotonic()) > 0:
        if time.monotonic() >= next_effect:
            _record(self.request, "effect")
            next_effect += EFFECT_EVERY
        time.sleep(min(0.05, left))
    _record(self.request, "finish")
    return {"seconds": seconds, "pid": os.getpid(), "node": self.request.hostname}


def _stored(sender: Any = None, **kwargs: Any) -> None:
    # task_success: the execution's outcome was handled (stored). A forfeit execution never gets here.
    if getattr(sender, "name", None) == TASK:
        _record(sender.request, "stored")


def _recovered(sender: Any = None, **kwargs: Any) -> None:
    """``orphan_recovered``: a recovery was sent, stamped by the Redis server's clock as the runs are. The
    audit row's time is the clock of the process that recorded it, which a clock step of the nemesis moves:
    a recovery recorded by a worker stepped 21 s behind looked 21 s older than the start of the very
    copy it recovered, which then counted as a stale copy run after its recovery."""
    if kwargs.get("task_name") == TASK and kwargs.get("task_id"):
        record = {"event": "recovered", "attempt": kwargs.get("attempt"), "evidence": kwargs.get("evidence")}
        _runs_redis().eval(STAMP, 1, RECOVERIES_KEY.format(kwargs["task_id"]), json.dumps(record))


if __name__ != "__main__":
    # Run as a script, this file is __main__: main() sets Django up, then imports it as benchmarks.chaos,
    # so the task is bound to the test project's Celery app rather than to a default app made too early.
    work = recoverable(max_attempts=10)(shared_task(bind=True, name=TASK)(_work))
    task_success.connect(_stored, dispatch_uid="chaos.stored")
    orphan_recovered.connect(_recovered, dispatch_uid="chaos.recovered")


# --- the run ---------------------------------------------------------------------------------------


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def group_pids(pgid: int) -> set[int]:
    """Every process in a process group (a worker's main process and its pool), from /proc."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid:  # fields after "(comm)": state, ppid, pgrp, ...
            found.add(int(entry.name))
    return found


@dataclass
class Kill:
    node: str
    at: float
    pids: set[int]
    restarted_as: str


@dataclass
class Pause:
    node: str
    at: float
    until: float
    pids: set[int]


@dataclass
class Fleet:
    """The workers, the killer and the sweeper of one run."""

    workdir: Path
    env: dict[str, str]
    run_id: str
    concurrency: int = 2
    kills: list[Kill] = field(default_factory=list)
    pauses: list[Pause] = field(default_factory=list)
    generation: int = 0
    pool: Any = None  # tests.workers.WorkerPool
    nemesis: Nemesis | None = None

    def __post_init__(self) -> None:
        from tests.workers import WorkerPool

        self.pool = WorkerPool(self.workdir, self.env)

    @property
    def workers(self) -> list[Any]:  # tests.workers.Worker
        return list(self.pool.workers)

    def start(self, name: str, wait: bool = True) -> Any:
        return self.pool.start(
            name,
            concurrency=self.concurrency,
            queues=(self.queue, self.sweep_queue),
            # A worker's own sweeps (at boot, and the watch's) run as in production, unless the run's
            # environment switches them off.
            env={
                **{name: self.env.get(name, value) for name, value in _own_sweeps_on().items()},
                **(self.nemesis.worker_env(name, self.env) if self.nemesis else {}),
            },
            include=("benchmarks.chaos",),
            wait=wait,
            ready_timeout=60,
        )

    @property
    def queue(self) -> str:
        return f"chaos-{self.run_id}"

    @property
    def sweep_queue(self) -> str:
        # Beat's reconcile task on a queue of its own, as docs/deployment.md advises: behind the backlog
        # of work it would run minutes late.
        return f"chaos-{self.run_id}-sweep"

    def node(self, label: str) -> str:
        """A node name no other run (or test) on this machine and broker uses."""
        return f"chaos-{label}-{self.run_id}@bench"

    def live(self) -> list[Any]:
        """The workers running and not stopped."""
        now = time.time()
        frozen = {p.node for p in self.pauses if p.at <= now < p.until + 1}
        if self.nemesis is not None:
            frozen |= self.nemesis.faulted()
        return [w for w in self.workers if w.is_running() and w.name not in frozen]

    def strike(self) -> None:
        """Let the nemesis strike; what it strikes may rightly cost the executions it holds up."""
        assert self.nemesis is not None
        fault = self.nemesis.strike(self.live(), group_pids)
        if fault is not None and fault.pids:
            self.pauses.append(Pause(fault.node, fault.at, fault.until, set(fault.pids)))

    def pause_one(self, rng: random.Random, seconds: float) -> Pause | None:
        """SIGSTOP a worker and its pool for ``seconds``, then SIGCONT it (a frozen VM, a debugger)."""
        candidates = self.live()
        if len(candidates) < 2:  # keep one worker running
            return None
        victim = rng.choice(candidates)
        pids = group_pids(victim.pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(victim.pid, signal.SIGSTOP)
        pause = Pause(victim.name, time.time(), time.time() + seconds, pids)
        self.pauses.append(pause)
        threading.Timer(seconds, self._thaw, args=(victim,)).start()
        log(f"stopped {victim.name} ({len(pids)} processes) for {seconds:g} s")
        return pause

    @staticmethod
    def _thaw(victim: Any) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(victim.pid, signal.SIGCONT)

    def kill_one(self, rng: random.Random) -> Kill:
        victim = rng.choice(self.live())
        pids = group_pids(victim.pid)
        victim.kill()
        self.generation += 1
        same = rng.random() < 0.5
        name = victim.name if same else self.node(str(self.generation))
        kill = Kill(victim.name, time.time(), pids, name)
        self.kills.append(kill)
        self.start(name, wait=False)
        log(f"killed {victim.name} ({len(pids)} processes); restarted as {name}")
        return kill

    def close(self) -> None:
        self.pool.close()


@dataclass
class Execution:
    """One run of a task's body: its start record and, if it got that far, its finish record."""

    start: dict[str, Any]
    finish: dict[str, Any] | None = None
    stored: dict[str, Any] | None = None

    @property
    def runner(self) -> tuple[str, int]:
        return str(self.start["node"]), int(self.start["pid"])

    def lost_to(self, kills: list[Kill]) -> bool:
        """Its process was SIGKILLed while it ran, or right after its body finished (before the result)."""
        began, pid = self.start["at"], self.start["pid"]
        ended = self.finish["at"] + LOST_AFTER_FINISH_SECONDS if self.finish else float("inf")
        return any(pid in k.pids and began <= k.at <= ended for k in kills)

    def forfeit_by(self, pauses: list[Pause]) -> bool:
        """Its process was stopped (or its worker cut off) while it ran, so long that its worker gave it
        up: the pause and the execution overlap."""
        began, pid = self.start["at"], self.start["pid"]
        ended = self.stored["at"] if self.stored else float("inf")
        return any(pid in p.pids and p.at <= ended and began <= p.until for p in pauses)

    def given_up_by(self, give_ups: list[tuple[str, float]]) -> bool:
        """Its worker gave its boot up while it ran (its lease lapsed: a stall, a cut, a refused write),
        so the execution was rightly forfeit. Log times come from the worker's clock, so a second of
        slack either way."""
        node, began = self.start["node"], self.start["at"]
        ended = self.finish["at"] if self.finish else float("inf")
        return any(n == node and began - 1 <= at <= ended + 1 for n, at in give_ups)

    def live_until(
        self, kills: list[Kill], pauses: list[Pause], fence: float, give_ups: list[tuple[str, float]]
    ) -> float:
        """Until when it was a live execution: its end, its kill, its fence once its worker stopped, or its
        worker's give-up of its boot (its pool process is killed at that instant; the log's time is the
        worker's clock, so a second of slack, as ``given_up_by`` allows). Without the give-ups, an
        execution stopped by a give-up no fault of the run explains (a pool process forked after the fault
        struck, a renewal late under load) stayed live for ever, and its recovery counted as a start
        beside it."""
        pid, node, began = self.start["pid"], self.start["node"], self.start["at"]
        ends = [e["at"] for e in (self.stored, self.finish) if e is not None]
        ends += [k.at for k in kills if pid in k.pids and k.at >= began]
        ends += [max(p.at, began) + fence for p in pauses if pid in p.pids and began <= p.until]
        ends += [at + 1 for n, at in give_ups if n == node and at >= began - 1]
        return min(ends, default=float("inf"))


@dataclass
class Result:
    tasks: int
    success: int
    finished_per_task: dict[int, int]
    starts: int
    extra_starts: int
    explained_by_kills: int
    lost_after_finish: int
    unexplained_extra_starts: int
    stale_copy_executions: int
    kills: int
    kills_same_name: int
    pauses: int
    duplicates_of_live: int
    duplicates_dropped: int
    recovered: int
    recovered_by_trigger: dict[str, int]
    stale_copies_dropped: int
    marked_terminal: int
    seconds: float
    overlapping_effects: int = 0
    overlap_window: float = 0.0
    left_unfinished: int = 0
    schedule: list[str] = field(default_factory=list)
    offenders: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        return [
            f"tasks SUCCESS: {self.success} of {self.tasks}",
            f"executions finished per task: {dict(sorted(self.finished_per_task.items()))} "
            f"(must be {{1: {self.tasks}}})",
            f"starts: {self.starts}; extra starts: {self.extra_starts}, explained by a kill, a fault or "
            f"a give-up of that very execution: {self.explained_by_kills} (of which "
            f"{self.lost_after_finish} killed after the body ended, before its result was stored), "
            f"unexplained: {self.unexplained_extra_starts} (must be 0)",
            f"stale-copy executions after recovery: {self.stale_copy_executions} (must be 0)",
            f"starts of a task while a live execution of it ran: {self.duplicates_of_live} (must be 0); "
            f"duplicate deliveries dropped by single flight: {self.duplicates_dropped}",
            f"kills: {self.kills} ({self.kills_same_name} restarted under the same name); pauses past the "
            f"lease: {self.pauses}; recoveries: "
            f"{self.recovered} {self.recovered_by_trigger}; stale copies dropped by the fence: "
            f"{self.stale_copies_dropped}; marked terminal: {self.marked_terminal}",
            f"side effects of a stale execution after a later one started: {self.overlapping_effects} "
            f"(must be 0), over {self.overlap_window:.2f} s",
            f"tasks left neither SUCCESS nor FAILURE: {self.left_unfinished} (must be 0)",
            f"duration: {self.seconds:.0f} s",
            *([f"nemesis schedule ({len(self.schedule)} faults):", *self.schedule] if self.schedule else []),
            *self.offenders,
        ]

    @property
    def ok(self) -> bool:
        return (
            self.success == self.tasks
            and self.finished_per_task == {1: self.tasks}
            and self.unexplained_extra_starts == 0
            and self.stale_copy_executions == 0
            and self.duplicates_of_live == 0
            and self.overlapping_effects == 0
            and self.left_unfinished == 0
        )


def executions_of(events: list[dict[str, Any]]) -> list[Execution]:
    """Pair each start with the finish recorded by the same process after it."""
    found: list[Execution] = []
    running: dict[int, Execution] = {}
    last: dict[int, Execution] = {}
    for e in sorted(events, key=lambda e: e["at"]):
        if e["event"] == "start":
            running[e["pid"]] = last[e["pid"]] = Execution(e)
            found.append(running[e["pid"]])
        elif e["event"] == "finish" and e["pid"] in running:
            running.pop(e["pid"]).finish = e
        elif e["event"] == "stored" and e["pid"] in last:
            last[e["pid"]].stored = e
    return found


def stale_effects(events: list[dict[str, Any]]) -> list[float]:
    """How late each side effect of an execution came after a later execution had started (Redis's clock).

    Every execution's records carry its own id; a body that acts after a newer copy of its task began is
    running beside it, whatever the reason.
    """
    starts = {e["execution"]: e["at"] for e in events if e["event"] == "start"}
    late = []
    for e in events:
        if e["event"] not in ("effect", "finish") or e["execution"] not in starts:
            continue
        newer = [at for at in starts.values() if starts[e["execution"]] < at <= e["at"]]
        if newer:
            late.append(e["at"] - min(newer))
    return late


def stored_runner(result: object) -> tuple[str, int] | None:
    """Which process's outcome the SUCCESS row holds (the task returns its node and pid)."""
    try:
        value = json.loads(result) if isinstance(result, str) else None
    except ValueError:
        return None
    if not isinstance(value, dict) or "pid" not in value:
        return None
    return str(value.get("node")), int(value["pid"])


GIVE_UP = re.compile(
    r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}): ERROR/MainProcess\] "
    r"celery-orphans: worker (\S+) gives up its boot",
    re.MULTILINE,
)


def given_up(fleet_logs: str) -> list[tuple[str, float]]:
    """When each worker gave its boot up (its executions forfeit), from the workers' logs."""
    return [
        (node, time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")) + int(millis) / 1000)
        for stamp, millis, node in GIVE_UP.findall(fleet_logs)
    ]


def analyse(
    ids: list[str], kills: list[Kill], pauses: list[Pause], fence: float, fleet_logs: str, started: float
) -> Result:
    """Count executions per task from their own records, the kills, the pauses and the audit log.

    ``fence`` is how long after its worker was stopped an execution still counts as live: the worker
    gives its executions up that long after its last renewal at the latest.
    """
    from django_celery_results.models import TaskResult

    from celery_orphans.decision import Evidence
    from celery_orphans.models import OrphanEvent

    give_ups = given_up(fleet_logs)
    conn = _runs_redis()
    events = {
        task_id: [parse_record(raw) for raw in conn.lrange(RUNS_KEY.format(task_id), 0, -1)]
        for task_id in ids
    }
    recoveries: dict[str, list[tuple[int, float]]] = {}
    audit = OrphanEvent.objects.filter(task_id__in=ids)
    fields = ("task_id", "action", "attempt", "created_at", "evidence")
    for task_id, action, attempt, created, evidence in audit.values_list(*fields):
        # A redelivery the broker made is counted as a recovery but sends no newer copy: the copy it
        # counts carries its old attempt and is the current one, not a stale one.
        if action == "recovered" and evidence != Evidence.BROKER_REDELIVERED:
            recoveries.setdefault(task_id, []).append((attempt or 0, created.timestamp()))
    # When each recovery was sent by the Redis server's clock, where its signal recorded it: the audit's
    # times come from clocks the nemesis may have stepped.
    for task_id in list(recoveries):
        stamped = [parse_record(raw) for raw in conn.lrange(RECOVERIES_KEY.format(task_id), 0, -1)]
        sent = [
            (int(r["attempt"] or 0), r["at"]) for r in stamped if r["evidence"] != Evidence.BROKER_REDELIVERED
        ]
        if len(sent) == len(recoveries[task_id]):
            recoveries[task_id] = sent
    rows = TaskResult.objects.filter(task_id__in=ids, status="SUCCESS").values_list("task_id", "result")
    stored = {task_id: stored_runner(result) for task_id, result in rows}
    finished: Counter[int] = Counter()
    starts = explained = after_finish = stale = live_duplicates = 0
    late_effects: list[float] = []
    offenders = []
    for task_id in ids:
        runs = executions_of(events[task_id])
        starts += len(runs)
        acted_late = stale_effects(events[task_id])
        late_effects += acted_late
        # An execution finished when its outcome was handled (task_success): a body that ended in a
        # process killed before it could store the result, or given up by its stopped worker, did not
        # finish the task, which rightly runs again.
        lost = [
            r
            for r in runs
            if (r.lost_to(kills) or r.forfeit_by(pauses) or r.given_up_by(give_ups))
            and r.stored is None
            and r.runner != stored.get(task_id)
        ]
        # Stored: its task_success was recorded, or the row holds its outcome (killed in between).
        done = [r for r in runs if r.stored is not None or r.runner == stored.get(task_id)]
        finished[len(done)] += 1
        # A start while another execution of the same task was still live runs that task twice.
        overlaps = [
            s
            for s in runs
            for e in runs
            if e is not s and e.start["at"] <= s.start["at"] < e.live_until(kills, pauses, fence, give_ups)
        ]
        live_duplicates += len(overlaps)
        explained += len(lost)
        after_finish += sum(1 for r in lost if r.finish is not None)
        # A copy older than a recovery already sent should have been dropped by the fence.
        late = [
            r
            for r in runs
            if any(a > r.start["attempt"] and at <= r.start["at"] for a, at in recoveries.get(task_id, []))
        ]
        stale += len(late)
        if len(done) != 1 or len(runs) - len(lost) != 1 or late or overlaps or acted_late:
            offenders.append(describe(task_id, runs, lost, recoveries.get(task_id, []), stored.get(task_id)))
    by_trigger = Counter(audit.filter(action="recovered").values_list("trigger", flat=True))
    return Result(
        tasks=len(ids),
        success=len(stored),
        finished_per_task=dict(finished),
        starts=starts,
        extra_starts=starts - len(ids),
        explained_by_kills=explained,
        lost_after_finish=after_finish,
        unexplained_extra_starts=starts - len(ids) - explained,
        stale_copy_executions=stale,
        kills=len(kills),
        kills_same_name=sum(1 for k in kills if k.restarted_as == k.node),
        pauses=len(pauses),
        duplicates_of_live=live_duplicates,
        duplicates_dropped=audit.filter(action="duplicate_dropped").count(),
        recovered=sum(by_trigger.values()),
        recovered_by_trigger=dict(by_trigger),
        stale_copies_dropped=fleet_logs.count("dropped a stale copy"),
        marked_terminal=audit.filter(action="marked_terminal").count(),
        seconds=time.time() - started,
        overlapping_effects=len(late_effects),
        overlap_window=max(late_effects, default=0.0),
        left_unfinished=len(ids) - len(stored) - audit.filter(action="marked_terminal").count(),
        offenders=offenders[:20],
    )


def describe(
    task_id: str,
    runs: list[Execution],
    lost: list[Execution],
    recoveries: list[tuple[int, float]],
    stored: tuple[str, int] | None,
) -> str:
    """One offending task's story, for the report."""
    parts = [
        f"{r.runner[0]}/{r.runner[1]} attempt {r.start['attempt']} {r.start['at']:.2f}-"
        f"{r.finish['at'] if r.finish else float('nan'):.2f}{' lost' if r in lost else ''}"
        for r in runs
    ]
    sent = ", ".join(f"attempt {a} at {at:.2f}" for a, at in sorted(recoveries))
    return f"  {task_id}: runs [{'; '.join(parts)}]; recoveries [{sent}]; stored by {stored}"


def sweep_loop(stop: threading.Event, every: float) -> None:
    """The regular sweep, as Beat would run it every ``every`` seconds."""
    from django.db import connection

    from celery_orphans.tasks import reconcile

    try:
        while not stop.wait(every):
            try:
                outcome = reconcile.run()
            except Exception as exc:  # a sweep that fails is logged and tried again, as Beat would
                log(f"sweep failed: {type(exc).__name__}: {exc}")
                continue
            if "recovered 0 orphaned tasks, marked 0" not in str(outcome) and outcome != "locked":
                log(f"sweep: {outcome}")
    finally:
        connection.close()


def queued(queue: str) -> int:
    """Messages waiting in the queue, on either broker."""
    from celery import current_app

    with current_app.connection_for_write() as conn:
        try:
            return int(conn.default_channel.queue_declare(queue, passive=True).message_count)
        except conn.channel_errors:  # the Redis transport has no queue once its list is empty
            return 0


def delete_queue(queue: str) -> None:
    """Remove the run's queue from the broker (a RabbitMQ queue outlives the run otherwise)."""
    from celery import current_app
    from kombu import Queue

    with current_app.connection_for_write() as conn, contextlib.suppress(*conn.channel_errors):
        Queue(queue, channel=conn.default_channel).delete()


def route_beat_to(queue: str) -> None:
    """Send Beat's reconcile task to ``queue``, which the run's workers consume."""
    from django_celery_beat.models import PeriodicTask, PeriodicTasks

    PeriodicTask.objects.filter(task="celery_orphans.reconcile").update(queue=queue, enabled=True)
    PeriodicTasks.update_changed()


def run(
    *,
    tasks: int,
    kill_every: float,
    workdir: Path,
    env: dict[str, str],
    sweeper: str = "loop",
    sweep_every: float | None = None,
    seed: int | None = None,
    timeout: float = 3600,
    pause_every: float = 0.0,
    long_share: float = 0.0,
    long_seconds: tuple[float, float] = (0.0, 0.0),
    nemesis: Nemesis | None = None,
    fault_every: float = 0.0,
    say: Callable[[str], None] = log,
) -> Result:
    """One chaos run in this (Django-configured) process; the workers get ``env``.

    With ``pause_every``, a worker is also stopped (``SIGSTOP``) that often for one and a half leases;
    ``long_share`` of the tasks run ``long_seconds`` (past the Redis visibility timeout) instead of 0.5 to
    3 s; with a ``nemesis``, it strikes a fault about every ``fault_every`` seconds.
    """
    from celery_orphans.conf import settings

    lease = float(env.get("CELERY_ORPHANS_LEASE_SECONDS", settings.LEASE_SECONDS))
    rng = random.Random(seed)
    fleet = Fleet(workdir, env, run_id=uuid.uuid4().hex[:8], nemesis=nemesis)
    stop = threading.Event()
    started = time.time()
    beat = None
    try:
        for i in range(3):
            fleet.start(fleet.node(f"w{i}"))
        if sweeper == "beat":
            route_beat_to(fleet.sweep_queue)
            beat = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "testproject", "beat", "--loglevel=INFO",
                 "-S", "django_celery_beat.schedulers:DatabaseScheduler", "-s", str(workdir / "beat")],
                cwd=PROJECT, env=env, stdout=open(workdir / "beat.log", "ab"),  # noqa: SIM115
                stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
            sweeping = None
        else:
            every = sweep_every or float(settings.SWEEP_INTERVAL_SECONDS)
            sweeping = threading.Thread(target=sweep_loop, args=(stop, every), daemon=True)
            sweeping.start()
        ids = [str(uuid.uuid4()) for _ in range(tasks)]
        for task_id in ids:
            seconds = rng.uniform(*long_seconds) if rng.random() < long_share else rng.uniform(0.5, 3.0)
            work.apply_async((round(seconds, 2),), task_id=task_id, queue=fleet.queue)
        pausing = f", a pause every ~{pause_every:g} s" if pause_every else ""
        say(f"queued {tasks} tasks on 3 workers; a kill every ~{kill_every:g} s{pausing}")

        from django_celery_results.models import TaskResult

        deadline = time.monotonic() + timeout
        next_kill = time.monotonic() + kill_every * rng.uniform(0.8, 1.2)
        next_pause = time.monotonic() + pause_every * rng.uniform(0.8, 1.2) if pause_every else float("inf")
        striking = nemesis is not None and fault_every > 0
        next_fault = time.monotonic() + fault_every * rng.uniform(0.8, 1.2) if striking else float("inf")
        while True:
            ended = Counter(
                TaskResult.objects.filter(task_id__in=ids, status__in=("SUCCESS", "FAILURE")).values_list(
                    "status", flat=True
                )
            )
            done = ended["SUCCESS"]
            # FAILURE: marked terminal (the task itself never fails), so it will not run again.
            if ended.total() == tasks or time.monotonic() > deadline:
                break
            if time.monotonic() >= next_kill and fleet.live():
                fleet.kill_one(rng)
                next_kill = time.monotonic() + kill_every * rng.uniform(0.8, 1.2)
                say(f"{done} of {tasks} done, {len(fleet.kills)} kills, {len(fleet.pauses)} pauses")
            if time.monotonic() >= next_pause:
                fleet.pause_one(rng, 1.5 * lease)
                next_pause = time.monotonic() + pause_every * rng.uniform(0.8, 1.2)
            if time.monotonic() >= next_fault:
                fleet.strike()
                next_fault = time.monotonic() + fault_every * rng.uniform(0.8, 1.2)
            time.sleep(0.2)
        # Let whatever copies are still queued reach a worker (a stale one must be dropped, not run).
        drained = time.monotonic() + 30
        while queued(fleet.queue) and time.monotonic() < drained:
            time.sleep(0.2)
        time.sleep(max([0.0, *(p.until - time.time() for p in fleet.pauses)]) + 1)  # every worker thawed
        if nemesis is not None:
            nemesis.heal()
        logs = "".join(w.log() for w in fleet.workers)
        result = analyse(ids, fleet.kills, fleet.pauses, 0.8 * lease, logs, started)
        result.schedule = nemesis.lines(started) if nemesis is not None else []
        return result
    finally:
        stop.set()
        if nemesis is not None:
            nemesis.close()
        if beat is not None and beat.poll() is None:
            os.killpg(beat.pid, signal.SIGKILL)
            beat.wait(timeout=10)
        fleet.close()
        for queue in (fleet.queue, fleet.sweep_queue):
            delete_queue(queue)


# --- the command line ------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=1000)
    parser.add_argument("--kill-every", type=float, default=5.0, help="seconds between kills (jittered)")
    parser.add_argument("--broker", choices=("redis", "amqp"), default="redis")
    parser.add_argument("--sweeper", choices=("beat", "loop"), default="beat")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--visibility-timeout", type=int, default=30, help="Redis transport, in seconds")
    parser.add_argument("--pause-every", type=float, default=0.0, help="seconds between SIGSTOPs (0: none)")
    parser.add_argument(
        "--long-share", type=float, default=0.0, help="share of tasks past the visibility timeout"
    )
    parser.add_argument(
        "--lease", type=float, default=3.0, help="CELERY_ORPHANS_LEASE_SECONDS of the workers"
    )
    parser.add_argument("--workdir", type=Path, default=None, help="keep worker logs here")
    parser.add_argument(
        "--nemesis",
        default="",
        help="faults struck at random besides the kills, comma-separated, or 'all': "
        "pause, freeze_main, blackhole, refuse_writes, clock_step (benchmarks/nemesis.py); the ledger then "
        "gets a Redis of its own, reached by each worker through a proxy",
    )
    parser.add_argument("--fault-every", type=float, default=8.0, help="seconds between nemesis faults")
    args = parser.parse_args()

    # Variables of its own, so a DATABASE_URL or REDIS_URL meant for the test suite is never used here.
    database_url = os.environ.get(
        "CHAOS_DATABASE_URL", f"postgres://postgres@127.0.0.1:5432/chaos_orphans_{args.broker}"
    )
    from tests.services import Vhost, ensure_database, own_redis

    given_amqp = os.environ.get("CHAOS_AMQP_URL")

    given_redis = os.environ.get("CHAOS_REDIS_URL")  # a Redis database the run may empty
    redis_url = given_redis or own_redis().url()
    vhost = Vhost("celery-orphans-chaos").create() if args.broker == "amqp" and not given_amqp else None
    amqp_url = given_amqp or (vhost.url() if vhost else "")
    ledger = None
    if args.nemesis:
        from tests.services import RedisServer

        ledger = RedisServer(Path(tempfile.mkdtemp(prefix="chaos-ledger-"))).start()
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "testproject.settings",
        "DATABASE_URL": database_url,
        "REDIS_URL": redis_url,
        "CELERY_BROKER_URL": amqp_url if args.broker == "amqp" else redis_url,
        "CELERY_ORPHANS_ENABLED": "true",
        # Short, so the transport restores killed workers' originals during the run: the fence must drop
        # every one of them.
        "TESTPROJECT_VISIBILITY_TIMEOUT": str(args.visibility_timeout),
        "CELERY_ORPHANS_LEASE_SECONDS": str(args.lease),
        "CELERY_ORPHANS_HEARTBEAT_SECONDS": str(args.lease / 5),
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(PROJECT)]),
        **({"CELERY_ORPHANS_REDIS_URL": ledger.url()} if ledger else {}),
    }
    os.environ.update(env)
    sys.path[:0] = [str(ROOT), str(PROJECT)]
    ensure_database(database_url)

    import django

    django.setup()
    import redis
    from django.core.management import call_command
    from django_celery_results.models import TaskResult

    from benchmarks import chaos  # the task, bound to the test project's app
    from celery_orphans.models import OrphanEvent

    call_command("migrate", verbosity=0)
    if given_redis:
        redis.Redis.from_url(redis_url).flushdb()
    TaskResult.objects.all().delete()
    OrphanEvent.objects.all().delete()

    with tempfile.TemporaryDirectory(prefix="chaos-") as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        nemesis = None
        if ledger is not None:
            from benchmarks.nemesis import KINDS
            from benchmarks.nemesis import Nemesis as Striker

            kinds = KINDS if args.nemesis == "all" else tuple(args.nemesis.split(","))
            nemesis = Striker(kinds, args.lease, ledger, workdir, random.Random(args.seed), log)
        result = chaos.run(
            tasks=args.tasks,
            kill_every=args.kill_every,
            workdir=workdir,
            env=env,
            sweeper=args.sweeper,
            seed=args.seed,
            pause_every=args.pause_every,
            long_share=args.long_share,
            long_seconds=(1.5 * args.visibility_timeout, 2.5 * args.visibility_timeout),
            timeout=args.timeout,
            nemesis=nemesis,
            fault_every=args.fault_every,
        )
    if vhost is not None:
        vhost.delete()
    if ledger is not None:
        ledger.stop()
    print(f"\nchaos, broker {args.broker}, sweeper {args.sweeper}:")
    for line in result.lines():
        print(f"  {line}")
    print("  PASS" if result.ok else "  FAIL")
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
