"""Ledger hygiene (P5): after thousands of tasks that end every way, nothing of theirs is left in Redis.

A ``-P prefork -c 2`` worker of ``benchmarks.hygiene_app`` runs ``--tasks`` ``@recoverable`` tasks that
succeed, fail, retry once and then succeed, are revoked before they run, or overrun a soft or a hard
time limit; half of each kind save a checkpoint first. Then, with the worker still up:

- no ledger entry is left (the in-flight index is empty and no entry key exists), nor any checkpoint;
- our keys are the same ones as before the tasks (the worker's lease and its boots), and the sum of
  their ``MEMORY USAGE`` is back at its level before the tasks, within 1 %.

The ledger lives on a ``redis-server`` of its own (the broker on another), so nothing else writes there;
its ``used_memory`` is printed beside, for information only: it moves by a few percent with the
connections open and the allocator's state.

    python benchmarks/hygiene.py                # 10,000 tasks
    python benchmarks/hygiene.py --quick        # 1,000 tasks
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]
from tests.services import provide_with_ledger_apart  # noqa: E402

TMP, LEDGER_URL = provide_with_ledger_apart("hygiene")

from benchmarks.hygiene_app import app  # noqa: E402  (sets Django up)

# isort: split
from celery import states  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django_celery_results.models import TaskResult  # noqa: E402

from benchmarks.throughput import NODE, start_worker  # noqa: E402
from celery_orphans.store import Keys, client  # noqa: E402
from tests.helpers import wait_for  # noqa: E402
from tests.workers import Worker  # noqa: E402

TOLERANCE = 0.01
# How the tasks end, in parts of a thousand. Time limits cost a pool process (hard) or a second of
# nothing (soft) each, so there are few of them.
MIX = {
    "succeed": 700,
    "fail": 120,
    "retry": 100,
    "revoke": 60,
    "soft_limit": 10,
    "hard_limit": 10,
}


def log(message: str) -> None:
    print(message, flush=True)


def footprint() -> dict[str, Any]:
    """Our keys by kind, the sum of their ``MEMORY USAGE``, and the server's ``used_memory``."""
    conn = client()
    prefix = Keys.current().prefix
    kinds: Counter[str] = Counter()
    usage = 0
    for key in conn.scan_iter(match=f"{prefix}:*", count=1000):
        kinds[key.decode().removeprefix(prefix + ":").split(":", 1)[0]] += 1
        usage += int(conn.memory_usage(key) or 0)
    return {
        "keys": dict(sorted(kinds.items())),
        "memory_usage_bytes": usage,
        "used_memory": int(conn.info("memory")["used_memory"]),
        "clients_memory": int(conn.info("memory")["mem_clients_normal"]),
        "entries": int(conn.zcard(Keys.current().inflight)) + kinds["entry"],
    }


def settled_footprint(samples: int = 5) -> dict[str, Any]:
    """``footprint()`` a few times a beat apart, keeping the median reading of our keys' memory.

    The lease key holds its last renewal time, whose length (and so its memory) can move by a few
    bytes with each renewal.
    """
    readings = []
    for _ in range(samples):
        readings.append(footprint())
        time.sleep(0.3)
    readings.sort(key=lambda r: int(r["memory_usage_bytes"]))
    return readings[len(readings) // 2]


def plan(count: int, seed: int = 5) -> list[tuple[str, bool]]:
    """``count`` (how it ends, saves a checkpoint) pairs in the mix's proportions, shuffled."""
    kinds = [kind for kind, share in MIX.items() for _ in range(share)]
    rng = random.Random(seed)
    chosen = [kinds[i % len(kinds)] for i in range(count)]
    rng.shuffle(chosen)
    return [(kind, i % 2 == 0) for i, kind in enumerate(chosen)]


def batch(worker: Worker, tasks: int, seed: int) -> dict[str, Any]:
    """Queue ``tasks`` planned tasks, revoke the ones to revoke, let the worker drain them all."""
    queue = f"bench.hygiene.{uuid.uuid4().hex[:8]}"
    prefix = f"hy-{queue}-"
    planned = plan(tasks, seed)
    revoked = []
    started = time.monotonic()
    with app.producer_or_acquire() as producer:
        for i, (kind, save) in enumerate(planned):
            task_id = f"{prefix}{i}"
            name = "succeed" if kind == "revoke" else kind
            app.send_task(
                f"bench.hygiene.{name}", args=(save,), task_id=task_id, queue=queue, producer=producer
            )
            if kind == "revoke":
                revoked.append(task_id)
    # Revoked before the worker consumes the queue: each is discarded when it arrives.
    for start in range(0, len(revoked), 500):
        app.control.revoke(revoked[start : start + 500])
    app.control.add_consumer(queue, destination=[NODE], reply=True, timeout=5)
    rows = TaskResult.objects.filter(task_id__startswith=prefix)

    def finished() -> bool:
        if not worker.is_running():
            raise RuntimeError(f"the worker stopped:\n{worker.log()[-4000:]}")
        return rows.filter(status__in=states.READY_STATES).count() >= tasks

    wait_for(finished, 120 + tasks / 20, f"{tasks} tasks to end", interval=0.5)
    ran = time.monotonic() - started
    emptying = time.monotonic()
    wait_for(lambda: footprint()["entries"] == 0, 30, "the ledger to empty", interval=0.1)
    emptied = time.monotonic() - emptying
    app.control.cancel_consumer(queue, destination=[NODE], reply=True, timeout=5)
    outcomes = dict(Counter(rows.values_list("status", flat=True)))
    rows.delete()
    with app.connection_for_write() as conn:
        conn.default_channel.queue_purge(queue)
    return {
        "tasks": tasks,
        "planned": dict(Counter(kind for kind, _ in planned)),
        "outcomes": outcomes,
        "seconds": ran,
        "ledger_emptied_after_seconds": emptied,
    }


def run(tasks: int, warmup: int, tmp: Path) -> dict[str, Any]:
    worker = start_worker(tmp, {"REDIS_URL": LEDGER_URL}, app_module="benchmarks.hygiene_app")
    try:
        # The start level is taken once the worker has run a few tasks of every kind: its connections
        # (a Redis client's buffers) and the Lua scripts it loads are there from then on, whatever the
        # number of tasks; what the benchmark looks for is what grows with them.
        warm = batch(worker, warmup, seed=1)
        before = settled_footprint()
        measured = batch(worker, tasks, seed=2)
        after = settled_footprint()
    finally:
        worker.kill()
    return {**measured, "warmup": warm, "before": before, "after": after}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="CI size: 1,000 tasks")
    parser.add_argument("--tasks", type=int, help="tasks to run (default 10,000)")
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "hygiene.json")
    args = parser.parse_args()
    tasks = args.tasks or (1_000 if args.quick else 10_000)

    call_command("migrate", verbosity=0)
    TaskResult.objects.filter(task_id__startswith="hy-").delete()
    results = run(tasks, max(100, tasks // 20), TMP)
    before, after = results["before"], results["after"]
    growth = after["memory_usage_bytes"] / max(1, before["memory_usage_bytes"]) - 1
    log(
        f"{tasks:,} tasks in {results['seconds']:.1f}s, ended {results['outcomes']}; the ledger was empty "
        f"{results['ledger_emptied_after_seconds']:.2f}s after the last one"
    )
    for label, f in (("before", before), ("after", after)):
        log(
            f"our keys {label:<6} {f['keys']} ({f['memory_usage_bytes']} B by MEMORY USAGE); the ledger "
            f"Redis's used_memory {f['used_memory']:,} B, {f['clients_memory']:,} B of it client buffers"
        )
    results["memory_growth"] = growth
    results["checks"] = [
        {
            "benchmark": "P5 ledger entries left",
            "target": "0",
            "measured": str(after["entries"]),
            "pass": after["entries"] == 0,
        },
        {
            # Our keys, by MEMORY USAGE, rather than the server's used_memory: that one moves by a few
            # percent with the connections open and the allocator's state, whatever the keys hold.
            "benchmark": "P5 our Redis memory",
            "target": "start +/- 1%",
            "measured": f"{growth:+.2%} ({before['memory_usage_bytes']:,} -> "
            f"{after['memory_usage_bytes']:,} B in {sum(after['keys'].values())} keys)",
            "pass": abs(growth) <= TOLERANCE and after["keys"] == before["keys"],
        },
    ]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))
    for c in results["checks"]:
        log(f"{c['benchmark']:<28}{c['target']:<16}{c['measured']:<40}{'PASS' if c['pass'] else 'FAIL'}")


if __name__ == "__main__":
    main()
