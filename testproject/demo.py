"""The demo: a worker is SIGKILLed mid-task, and its tasks are found and recovered, step by step.

Run it with ``bash testproject/demo.sh`` (which sets up a virtualenv first). It starts a Redis server of
its own and uses a new SQLite database in .demo/ (see ``configure``).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROJECT = ROOT / "testproject"
STATE = ROOT / ".demo"
WORKER = "demo@localhost"
T0 = time.monotonic()


def say(message: str) -> None:
    print(f"[{time.monotonic() - T0:6.2f}s] {message}", flush=True)


def configure() -> Path:
    """Services of the demo's own: a Redis server it starts (stopped when it exits) and a new SQLite
    database in a directory of this run's own under .demo/ (two demos at once never share a file),
    unless DEMO_REDIS_URL (a Redis database the demo empties) or DEMO_DATABASE_URL name others.
    Returns the run's directory, where the worker's log goes too."""
    STATE.mkdir(exist_ok=True)
    run = Path(tempfile.mkdtemp(prefix="run-", dir=STATE))
    sys.path[:0] = [str(ROOT), str(PROJECT)]
    from tests.services import own_redis

    os.environ["REDIS_URL"] = os.environ.get("DEMO_REDIS_URL") or own_redis().url()
    os.environ.pop("CELERY_BROKER_URL", None)  # the broker is that Redis too
    if os.environ.get("DEMO_DATABASE_URL"):
        os.environ["DATABASE_URL"] = os.environ["DEMO_DATABASE_URL"]
    else:
        os.environ["DATABASE_URL"] = f"sqlite:///{run / 'demo.sqlite3'}"
    os.environ["DJANGO_SETTINGS_MODULE"] = "testproject.settings"
    os.environ["CELERY_ORPHANS_ENABLED"] = "true"
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(PROJECT)])
    return run


def start_worker(log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "testproject",
                "worker",
                "-n",
                WORKER,
                "-c",
                "3",
                "--loglevel=INFO",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
            ],
            cwd=PROJECT,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + 60
    while b" ready." not in log.read_bytes().split(b"celery-orphans-demo-start")[-1]:
        if process.poll() is not None or time.monotonic() > deadline:
            sys.exit(f"The worker did not start; see {log}")
        time.sleep(0.05)
    return process


def main() -> None:
    run = configure()
    import django

    django.setup()
    import logging

    logging.getLogger("celery_orphans").setLevel(logging.WARNING)  # the demo narrates itself
    from celery import chain
    from demoapp.tasks import add, runs, scan, summarize
    from django.core.management import call_command
    from django_celery_results.models import TaskResult

    from celery_orphans import sweep
    from celery_orphans.models import OrphanEvent, Trigger
    from celery_orphans.store import client

    worker = None
    try:
        database = os.environ["DATABASE_URL"].split("://")[0]
        say(f"database {database}, redis {os.environ['REDIS_URL'].rsplit('@')[-1]}")
        call_command("migrate", verbosity=0)
        if os.environ.get("DEMO_REDIS_URL"):
            client().flushdb()  # given to the demo to empty
        say("migrated")

        log = run / "worker.log"
        log.write_text("celery-orphans-demo-start\n")
        worker = start_worker(log)
        say(f"worker {WORKER} is up (pid {worker.pid}), holding a lease in Redis")

        summary = summarize.delay(list(range(1, 11)), seconds=8)
        ticket = scan.delay("db-1", seconds=8)
        pipeline = chain(add.s(2, 3, seconds=8), add.s(10)).delay()
        say(f"sent summarize[{summary.id}]  (@recoverable)")
        say(f"sent scan[{ticket.id}]       (not recoverable: it files tickets)")
        say(f"sent chain add(2, 3) | add(10), first link [{pipeline.parent.id}] (@recoverable)")
        ids = [summary.id, ticket.id, pipeline.parent.id]
        # STARTED is written just before a task's body runs; wait for the bodies themselves.
        while TaskResult.objects.filter(task_id__in=ids, status="STARTED").count() < 3 or not all(
            runs(task_id) for task_id in ids
        ):
            time.sleep(0.05)
        say("all three are STARTED on the worker")

        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()
        killed_at = time.monotonic()
        say("SIGKILL the worker and its pool, mid-task (as an OOM kill or a node loss would)")
        states = dict(TaskResult.objects.filter(task_id__in=ids).values_list("task_id", "status"))
        say(f"result rows now: {sorted(states.values())} - and nothing would ever run them again")

        log.write_text(log.read_text() + "celery-orphans-demo-start\n")
        worker = start_worker(log)
        say(f"worker restarted under the same name {WORKER} (pid {worker.pid})")

        say("the restarted worker looks for what its previous boot left running (no Beat needed)")
        deadline = time.monotonic() + 60
        while OrphanEvent.objects.filter(task_id__in=ids).count() < len(ids):
            if time.monotonic() > deadline:
                sys.exit(f"The orphans were not handled in time; see {log}")
            time.sleep(0.05)
        for event in OrphanEvent.objects.filter(task_id__in=ids).order_by("id"):
            say(
                f"  {event.task_name:<18} {event.action:<16} reason: {event.reason:<16} "
                f"evidence: {event.evidence} (by {event.get_trigger_display().lower()})"
            )
        say(f"all three handled {time.monotonic() - killed_at:.2f}s after the kill")
        report = sweep.run(sweep.Options(trigger=Trigger.COMMAND, dry_run=True))
        say(f"a sweep now finds nothing left to do: {report.summary()}")

        say(f"summarize -> {summary.get(timeout=60)} (same id {summary.id})")
        say(f"chain     -> {pipeline.get(timeout=60)} (the second link ran after the recovered first)")
        say(f"both finished {time.monotonic() - killed_at:.2f}s after the kill (each task sleeps 8s)")
        ticket_row = TaskResult.objects.get(task_id=ticket.id)
        say(f"scan      -> {ticket_row.status}: {ticket_row.traceback}")
        for name, task_id in (("summarize", summary.id), ("scan", ticket.id)):
            events = [e.split(":")[0] for e in runs(task_id)]
            say(f"executions of {name}: {events.count('start')} started, {events.count('finish')} finished")

        worker, steps_id, killed_after = kill_a_checkpointing_task(worker, log)
        show_it_resumed(steps_id, killed_after)
        stop(worker)
        worker = None
        shutil.rmtree(run)  # kept, with the worker's log, when a step failed
    finally:
        if worker is not None:
            stop(worker)


def stop(worker: subprocess.Popen[bytes]) -> None:
    if worker.poll() is None:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)


# -- Last step: a long task resumes from its checkpoint ----------------------------------------------

STEPS = 100


def kill_a_checkpointing_task(
    worker: subprocess.Popen[bytes], log: Path
) -> tuple[subprocess.Popen[bytes], str, int]:
    """Kill the worker part way through a task that saves a checkpoint after every step; restart it."""
    from demoapp.tasks import count_steps, steps_executed

    print(flush=True)
    say("--- a long task resumes from its checkpoint ---")
    result = count_steps.delay(STEPS, seconds=0.05)
    say(f"sent count_steps({STEPS})[{result.id}]: 0.05s a step, a checkpoint saved after each")
    deadline = time.monotonic() + 60
    while steps_executed(result.id) < 40:
        if time.monotonic() > deadline:
            sys.exit(f"count_steps did not get going; see {log}")
        time.sleep(0.02)
    os.killpg(worker.pid, signal.SIGKILL)
    worker.wait()
    killed_after = steps_executed(result.id)
    say(f"SIGKILL the worker after step {killed_after}")
    log.write_text(log.read_text() + "celery-orphans-demo-start\n")
    worker = start_worker(log)
    say(f"worker restarted under the same name (pid {worker.pid}); its boot sweep recovers the task")
    return worker, result.id, killed_after


def show_it_resumed(task_id: str, killed_after: int) -> None:
    from celery.result import AsyncResult
    from demoapp.tasks import runs, steps_executed

    from celery_orphans.models import OrphanEvent

    say(f"count_steps -> {AsyncResult(task_id).get(timeout=60)} (same id {task_id})")
    starts = [e.split(":")[0] for e in runs(task_id) if e.startswith("start")]
    resumed_at = int(starts[-1].split("@")[1])
    say(f"runs: {', '.join(starts)} - the recovered run went on from step {resumed_at + 1}, not from 1")
    say(
        f"steps executed in all: {steps_executed(task_id)} for {STEPS} "
        f"({killed_after} before the kill, {STEPS - resumed_at} after)"
    )
    event = OrphanEvent.objects.get(task_id=task_id)
    saved_at = f"{event.checkpoint_saved_at:%H:%M:%S.%f}"[:-3] if event.checkpoint_saved_at else "never"
    say(
        f"audit: {event.action} (attempt {event.attempt}); its last checkpoint, "
        f"{event.checkpoint_bytes} bytes, was saved at {saved_at} UTC"
    )


if __name__ == "__main__":
    main()
