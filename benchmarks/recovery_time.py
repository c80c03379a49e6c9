"""Time to recover (P1, P2): from SIGKILL of a worker running a recoverable task to that task running again.

P1: the worker is restarted under the same node name (systemd, a container restarted in place).
P2: the worker never comes back; another worker is up on the same machine, and Beat runs the reconcile as
    in production. The live worker's heartbeat sees the dead one's process gone (the watch).
P2b: the same, but no live worker can see the dead one's process: it ran in a pid namespace of its own
    (``unshare``), as a worker on another machine or in a container of its own does. Its lease decides.

Default celery-orphans settings throughout (heartbeat, lease, grace, sweep interval); real workers, a
real Beat, Redis and PostgreSQL. "Running again" is the moment the re-run records its start.

P2's kills are spread over Beat's sweep interval: each trial starts right after the previous recovery,
itself made by a sweep, so kills at a fixed delay would all fall at the same moment of the interval,
and the distribution would show one waiting time instead of the range a real kill meets. With N
trials, one kill falls at a random moment of each N-th of the interval, in a shuffled order (a seeded
draw, ``--seed``). Below ``MIN_TRIALS`` trials a percentile is printed but not judged.

    python benchmarks/recovery_time.py --trials 20
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "testproject")]
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "testproject.settings")
from tests.services import ensure_database, provide  # noqa: E402

# A database of its own (it deletes every result row) and a Redis server of its own.
DATABASE_URL = os.environ.get(
    "BENCH_RECOVERY_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/bench_recovery"
)
provide(DATABASE_URL)
ensure_database(DATABASE_URL)
os.environ["CELERY_ORPHANS_ENABLED"] = "true"

import django  # noqa: E402

django.setup()

from demoapp.tasks import runs, summarize  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django_celery_results.models import TaskResult  # noqa: E402
from testproject.celery import app  # noqa: E402

from benchmarks.interleave import spread  # noqa: E402
from celery_orphans.conf import settings  # noqa: E402
from celery_orphans.models import OrphanEvent  # noqa: E402
from tests.helpers import wait_for  # noqa: E402
from tests.workers import OWN_SWEEPS_ON, PROJECT, Worker, WorkerPool, process_tree  # noqa: E402

MIN_TRIALS = 5  # fewer cannot judge a median or a 95th percentile


def starts(task_id: str) -> list[float]:
    return [float(e.split(":")[2]) for e in runs(task_id) if e.startswith("start")]


def wait_started(task_id: str, worker: str) -> None:
    wait_for(
        lambda: TaskResult.objects.filter(task_id=task_id, status="STARTED", worker=worker).exists(),
        30,
        f"{task_id} to start on {worker}",
    )


def wait_rerun(task_id: str, timeout: float, watched: Worker) -> None:
    """Wait for the re-run of ``task_id`` to start; if it never does, show what ``watched`` was doing."""
    try:
        wait_for(lambda: len(starts(task_id)) >= 2, timeout, "the re-run to start")
    except AssertionError:
        print(f"  no re-run of {task_id}; the stacks of {watched.name}'s processes:", flush=True)
        print(stacks(watched.pid), flush=True)
        raise


def stacks(pid: int) -> str:
    """``py-spy dump`` of a worker's main process and its pool processes (py-spy: the bench extra)."""
    spy = Path(sys.executable).with_name("py-spy")
    if not spy.exists():
        return f"  (no {spy}: pip install -e '.[bench]' to see them)"
    dumps = []
    for each in process_tree(pid):
        done = subprocess.run([spy, "dump", "--pid", str(each)], capture_output=True, text=True, timeout=60)
        dumps.append(done.stdout or done.stderr)
    return "\n".join(dumps)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def summary(values: list[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "p50": statistics.median(values),
        "p95": percentile(values, 0.95),
        "max": max(values),
        "min": min(values),
    }


def judged(values: list[float], met: bool) -> bool | None:
    return met if len(values) >= MIN_TRIALS else None


def same_name(pool: WorkerPool, trials: int) -> list[float]:
    times = []
    worker = pool.start("p1@bench", env=OWN_SWEEPS_ON)
    for i in range(trials):
        result = summarize.delay([i], seconds=30)
        wait_started(result.id, "p1@bench")
        time.sleep(0.5)  # let it run a little, as a real task would have
        worker.kill()
        killed = time.time()
        worker = pool.start("p1@bench", env=OWN_SWEEPS_ON)
        wait_rerun(result.id, 60, worker)
        times.append(starts(result.id)[1] - killed)
        app.control.revoke(result.id, terminate=True)
        print(f"  P1 trial {i + 1}: {times[-1]:.2f}s", flush=True)
    worker.stop()  # a warm shutdown gives up its lease: nothing of it is left for the next case's watch
    return times


# A pid namespace of its own, as another machine or a container of its own would give the victim.
ELSEWHERE = ("unshare", "--pid", "--fork", "--mount-proc")


def elsewhere_possible() -> bool:
    return subprocess.run([*ELSEWHERE, "true"], capture_output=True).returncode == 0


def never_back(
    pool: WorkerPool, trials: int, rng: random.Random, label: str = "P2", wrapper: tuple[str, ...] = ()
) -> list[float]:
    survivor = f"{label.lower()}-survivor@bench"
    surviving = pool.start(survivor, queues=("celery",), concurrency=2, env=OWN_SWEEPS_ON)
    times = []
    delays = spread(trials, settings.SWEEP_INTERVAL_SECONDS, rng)
    for i in range(trials):
        name = f"{label.lower()}-victim-{i}@bench"
        victim = pool.start(name, queues=("victim",), env=OWN_SWEEPS_ON, wrapper=wrapper)
        result = summarize.apply_async(([i],), {"seconds": 60}, queue="victim")
        wait_started(result.id, name)
        app.control.add_consumer("victim", destination=[survivor], reply=True, timeout=5)
        time.sleep(0.5 + delays[i])
        victim.kill()
        killed = time.time()
        wait_rerun(result.id, 120, surviving)
        times.append(starts(result.id)[1] - killed)
        event = OrphanEvent.objects.filter(task_id=result.id).first()
        if event is not None:
            after = event.created_at.timestamp() - killed
            print(f"    recovered by {event.trigger} ({event.evidence}) {after:.2f}s after the kill")
        app.control.cancel_consumer("victim", destination=[survivor], reply=True, timeout=5)
        app.control.revoke(result.id, terminate=True)
        print(f"  {label} trial {i + 1}: {times[-1]:.2f}s", flush=True)
    surviving.stop()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trials", type=int, default=20, help="P1 trials (and P2's unless --p2-trials)")
    parser.add_argument("--p2-trials", type=int, help="P2 trials")
    parser.add_argument(
        "--p2b-trials", type=int, default=8, help="P2b trials (each waits out a lease); 0 to skip"
    )
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "recovery_time.json")
    parser.add_argument("--p1-done", type=Path, help="a file to create once the P1 trials have ended")
    parser.add_argument("--seed", type=int, default=1, help="for the moments of the P2 kills")
    args = parser.parse_args()

    call_command("migrate", verbosity=0)
    TaskResult.objects.all().delete()
    print(
        f"defaults: heartbeat {settings.HEARTBEAT_SECONDS}s, lease {settings.LEASE_SECONDS}s, "
        f"grace {settings.GRACE_SECONDS}s, sweep every {settings.SWEEP_INTERVAL_SECONDS}s",
        flush=True,
    )

    tmp = Path(tempfile.mkdtemp(prefix="celery-orphans-bench-"))
    pool = WorkerPool(tmp, {**os.environ, "PYTHONPATH": str(ROOT)})
    beat_log = open(tmp / "beat.log", "wb")  # noqa: SIM115
    beat = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "testproject",
            "beat",
            "--loglevel=INFO",
            "-S",
            "django_celery_beat.schedulers:DatabaseScheduler",
            "--pidfile=",
        ],
        cwd=PROJECT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=beat_log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        try:
            p1 = same_name(pool, args.trials)
        finally:
            if args.p1_done:
                args.p1_done.touch()
        p2 = never_back(pool, args.p2_trials or args.trials, random.Random(args.seed))
        p2b: list[float] = []
        if args.p2b_trials and elsewhere_possible():
            p2b = never_back(pool, args.p2b_trials, random.Random(args.seed), "P2b", ELSEWHERE)
        elif args.p2b_trials:
            print("P2b skipped: unshare cannot make a pid namespace here", flush=True)
    finally:
        os.killpg(beat.pid, signal.SIGTERM)
        beat.wait(timeout=10)
        pool.close()
    results = {
        "P1_same_name_restart": {
            **summary(p1),
            "target": "p95 <= 10s",
            "pass": judged(p1, percentile(p1, 0.95) <= 10),
        },
        "P2_never_back": {
            **summary(p2),
            "target": "p95 <= 5s",
            "pass": judged(p2, percentile(p2, 0.95) <= 5),
        },
    }
    if p2b:
        # Bounded by the lease: it lapses at most LEASE_SECONDS after the last renewal, and the next
        # renewal of the live worker, at most a heartbeat later, sees it.
        bound = settings.LEASE_SECONDS + settings.HEARTBEAT_SECONDS + 1
        results["P2b_never_back_not_seen"] = {
            **summary(p2b),
            "target": f"p95 <= {bound:g}s",
            "pass": judged(p2b, percentile(p2b, 0.95) <= bound),
        }
    print(f"\n{'benchmark':<24}{'n':>4}{'p50':>8}{'p95':>8}{'max':>8}  target                   result")
    for name, r in results.items():
        print(
            f"{name:<24}{r['n']:>4}{r['p50']:>7.2f}s{r['p95']:>7.2f}s{r['max']:>7.2f}s  {r['target']:<24} "
            f"{'n/a' if r['pass'] is None else 'PASS' if r['pass'] else 'FAIL'}"
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
