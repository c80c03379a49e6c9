"""Throughput (P4): what celery-orphans' per-task hooks cost a worker.

One worker (``-P prefork -c 2``) of ``benchmarks.throughput_app`` runs the same no-op and 10 ms tasks in
two sets: plain (our recommended Celery settings, not recoverable) and ``@recoverable`` (one Redis Lua call
sent before each task runs, its answer read later, which also carries the removal of the entries of tasks
acknowledged since). The worker's lease heartbeat (one Redis write every 2 s) runs throughout, for both
sets.

A run queues a whole batch first, then tells the worker to consume that queue, and counts from the first
task's ``date_started`` to the last one's ``date_done``, so publishing never competes with the worker for
the CPU. Runs are
interleaved (plain, ours, ours, plain, ...) and each figure is the median of ``--trials`` runs.

    python benchmarks/throughput.py --trials 7
    python benchmarks/throughput.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

from benchmarks.throughput_app import TASKS, app  # noqa: E402  (sets Django up)

# isort: split
import redis  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django.db.models import Max, Min  # noqa: E402
from django_celery_results.models import TaskResult  # noqa: E402
from kombu.exceptions import OperationalError as KombuOperationalError  # noqa: E402

from celery_orphans.store import Keys, client  # noqa: E402
from tests.workers import Worker, wait_for  # noqa: E402

NODE = "throughput@bench"
VARIANTS = ("plain", "ours")
KINDS = ("noop", "sleep10ms")
TARGET = 0.97
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def log(message: str) -> None:
    print(message, flush=True)


def start_worker(
    tmp: Path, extra_env: dict[str, str] | None = None, app_module: str = "benchmarks.throughput_app"
) -> Worker:
    log_path = tmp / "worker.log"
    command = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        app_module,
        "worker",
        "-n",
        NODE,
        "-P",
        "prefork",
        "-c",
        "2",
        "-Q",
        "bench.idle",
        "--loglevel=WARNING",
        "--without-gossip",
        "--without-mingle",
        "--without-heartbeat",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CELERY_ORPHANS_BOOT_SWEEP": "false", **(extra_env or {})}
    with open(log_path, "ab") as out:
        process = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    worker = Worker(name=NODE, log_path=log_path, process=process)
    wait_for(
        lambda: worker.is_running() and app.control.inspect(destination=[NODE], timeout=0.5).ping(),
        60,
        "the throughput worker to answer",
        interval=0.5,
    )
    if not worker.is_running():
        raise RuntimeError(f"the worker exited:\n{worker.log()[-4000:]}")
    return worker


# Other work shares this machine and this Redis server: a test that cuts every client's connection or
# pauses Redis, or something that stops our worker, would spoil a run. Such a run is made again, and the
# output says so.
CUT = (redis.ConnectionError, redis.TimeoutError, KombuOperationalError, ConnectionError)


class WorkerGone(Exception):
    pass


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process and its descendants (the pool children), from /proc."""
    total = 0.0
    pending = [pid]
    while pending:
        current = pending.pop()
        try:
            fields = Path(f"/proc/{current}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
            for task in Path(f"/proc/{current}/task").iterdir():
                pending.extend(int(c) for c in (task / "children").read_text().split())
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


@dataclass(frozen=True)
class Run:
    rate: float  # tasks per second
    cpu_ms: float  # the worker's CPU time per task, all its processes


def run_batch(worker: Worker, variant: str, kind: str, size: int) -> Run:
    """Queue ``size`` tasks, let the worker drain them; its rate and CPU time per task."""
    name = TASKS[(variant, kind)]
    queue = f"bench.run.{uuid.uuid4().hex[:8]}"
    prefix = f"tp-{queue}-"
    runs = TaskResult.objects.filter(task_id__startswith=prefix)

    def drained() -> bool:
        if not worker.is_running():
            raise WorkerGone("the worker stopped during the run")
        return runs.filter(status="SUCCESS").count() == size

    try:
        with app.producer_or_acquire() as producer:
            for i in range(size):
                app.send_task(name, task_id=f"{prefix}{i}", queue=queue, producer=producer)
        cpu = tree_cpu_seconds(worker.pid)
        app.control.add_consumer(queue, destination=[NODE], reply=True, timeout=5)
        wait_for(drained, 600, f"{size} {name}", interval=0.25)
        cpu = tree_cpu_seconds(worker.pid) - cpu
        # From the first start to the last finish, as the worker recorded them: the up to 1 s the Redis
        # transport takes to notice a newly added queue is left out.
        span = runs.aggregate(first=Min("date_started"), last=Max("date_done"))
        return Run(size / (span["last"] - span["first"]).total_seconds(), 1000 * cpu / size)
    finally:
        if worker.is_running():
            app.control.cancel_consumer(queue, destination=[NODE], reply=True, timeout=5)
        with app.connection_for_write() as conn:
            conn.default_channel.queue_purge(queue)
        runs.delete()


class Runner:
    """The worker, started again if something outside stops it."""

    def __init__(self, tmp: Path, env: dict[str, str] | None = None) -> None:
        self.tmp = tmp
        self.env = env
        self.worker = start_worker(tmp, env)
        self.restarts = 0

    def batch(self, variant: str, kind: str, size: int, tries: int = 3) -> Run:
        for attempt in range(1, tries + 1):
            if not self.worker.is_running():
                log("  the worker was stopped from outside; starting it again")
                self.worker = start_worker(self.tmp, self.env)
                self.restarts += 1
            try:
                return run_batch(self.worker, variant, kind, size)
            except (*CUT, WorkerGone) as exc:
                if attempt == tries:
                    raise
                log(f"  {type(exc).__name__}: {exc}; running this batch again")
                time.sleep(6)  # outlast a CLIENT PAUSE
        raise AssertionError("unreachable")

    def close(self) -> None:
        # The entries of the last tasks go just after their acknowledgement (with the next ledger
        # write, or 0.2 s later when none follows): give that a moment before the SIGKILL, so that
        # "ledger entries left" counts entries that were never going to go, not ones on their way out.
        deadline = time.monotonic() + 5
        while ledger_left() and time.monotonic() < deadline:
            time.sleep(0.05)
        self.worker.kill()  # SIGKILL to the process group: the pool children go too


def ledger_left() -> int:
    return int(client().zcard(Keys.current().inflight))


def measure(runner: Runner, trials: int, seconds: float, warmups: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for kind in KINDS:
        # Size the batch so that one run takes about ``seconds``.
        warm = statistics.mean(runner.batch(v, kind, 50).rate for v in VARIANTS for _ in range(warmups))
        size = max(50, int(warm * seconds))
        runs: dict[str, list[Run]] = {v: [] for v in VARIANTS}
        for trial in range(trials):
            order = VARIANTS if trial % 2 == 0 else VARIANTS[::-1]
            for variant in order:
                runs[variant].append(runner.batch(variant, kind, size))
            log(
                f"  {kind} trial {trial + 1}: "
                + ", ".join(
                    f"{v} {runs[v][-1].rate:.0f}/s ({runs[v][-1].cpu_ms:.2f} ms CPU/task)" for v in VARIANTS
                )
            )
        rates = {v: [r.rate for r in runs[v]] for v in VARIANTS}
        cpu = {v: [r.cpu_ms for r in runs[v]] for v in VARIANTS}
        plain, ours = (statistics.median(rates[v]) for v in VARIANTS)
        plain_cpu, ours_cpu = (statistics.median(cpu[v]) for v in VARIANTS)
        results[kind] = {
            "batch": size,
            "plain_runs": rates["plain"],
            "ours_runs": rates["ours"],
            "plain": plain,
            "ours": ours,
            "ratio": ours / plain,
            # Paired by trial, so slow spells on the shared machine hit both sides.
            "paired_ratio_median": statistics.median(o / p for o, p in zip(rates["ours"], rates["plain"])),
            # CPU time is far less sensitive to other work on the machine than a rate is.
            "plain_cpu_ms_per_task": plain_cpu,
            "ours_cpu_ms_per_task": ours_cpu,
            "plain_cpu_runs": cpu["plain"],
            "ours_cpu_runs": cpu["ours"],
        }
        log(
            f"{kind}: batch {size}, plain {plain:.0f}/s, ours {ours:.0f}/s, "
            f"ours/plain {ours / plain:.1%} (paired median {results[kind]['paired_ratio_median']:.1%}); "
            f"worker CPU per task plain {plain_cpu:.2f} ms, ours {ours_cpu:.2f} ms "
            f"({ours_cpu / plain_cpu - 1:+.1%})"
        )
    return results


def profile_hooks(tmp: Path, size: int) -> dict[str, dict[str, float]]:
    """Wall time of each per-task hook, timed inside a worker running one batch of the @recoverable no-op."""
    conn = client()
    for key in conn.scan_iter("bench:hooks:*"):
        conn.delete(key)
    runner = Runner(tmp, {"BENCH_TIME_HOOKS": "1"})
    try:
        runner.batch("ours", "noop", size)
    finally:
        runner.close()
    stats = {}
    for key in sorted(conn.scan_iter("bench:hooks:*")):
        values = sorted(float(v) for v in conn.lrange(key, 0, -1))
        stats[key.decode().removeprefix("bench:hooks:")] = {
            "calls": len(values),
            "mean_ms": 1000 * statistics.mean(values),
            "median_ms": 1000 * statistics.median(values),
            "p90_ms": 1000 * values[int(0.9 * (len(values) - 1))],
        }
    return stats


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="CI size: 2 trials of about 1 s each")
    parser.add_argument("--trials", type=int, default=None, help="runs per variant and task (default 7)")
    parser.add_argument("--seconds", type=float, default=None, help="length of one run (default 3)")
    parser.add_argument(
        "--profile-hooks",
        action="store_true",
        help="time each per-task hook inside a worker (done anyway when a full-size target is missed)",
    )
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "throughput.json")
    args = parser.parse_args()
    trials = args.trials or (2 if args.quick else 7)
    seconds = args.seconds or (1.0 if args.quick else 3.0)

    call_command("migrate", verbosity=0)
    TaskResult.objects.filter(task_id__startswith="tp-").delete()
    tmp = Path(tempfile.mkdtemp(prefix="celery-orphans-throughput-"))
    client().flushdb()  # db 13 is ours alone: no key of an earlier run, or of an older package version
    runner = Runner(tmp)
    try:
        results = measure(runner, trials, seconds, warmups=1 if args.quick else 2)
    finally:
        runner.close()
    results["worker_restarted_from_outside"] = runner.restarts
    missed = any(results[kind]["ratio"] < TARGET for kind in KINDS)
    if args.profile_hooks or (missed and not args.quick):
        noop = results["noop"]
        results["hooks"] = hooks = profile_hooks(tmp, noop["batch"])
        log(f"per-task hooks of the @recoverable no-op, timed in the worker ({noop['batch']} tasks):")
        for label, h in hooks.items():
            log(
                f"  {label:<46} mean {h['mean_ms']:.2f} ms, median {h['median_ms']:.2f} ms, "
                f"p90 {h['p90_ms']:.2f} ms ({h['calls']} calls)"
            )
        gap = 1000 / noop["ours"] - 1000 / noop["plain"]
        main = sum(h["mean_ms"] for label, h in hooks.items() if "main process" in label)
        log(
            f"  the worker's time per task grew by {gap:.2f} ms (1/ours - 1/plain); "
            f"the hooks in its main process take {main:.2f} ms"
        )
        results["noop"]["time_per_task_gap_ms"] = gap
    results["ledger_entries_left"] = ledger_left()
    results["trials"] = trials
    results["quick"] = args.quick
    results["checks"] = [
        {
            "benchmark": f"P4 throughput, {kind}",
            "target": f">= {TARGET:.0%} of plain",
            "measured": f"{results[kind]['ratio']:.1%}",
            "pass": results[kind]["ratio"] >= TARGET,
        }
        for kind in KINDS
    ]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))
    for c in results["checks"]:
        log(f"{c['benchmark']:<28}{c['target']:<18}{c['measured']:<10}{'PASS' if c['pass'] else 'FAIL'}")


if __name__ == "__main__":
    main()
