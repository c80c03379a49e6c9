"""The admin's in-flight page at scale: what a load costs with 100,000 STARTED rows, alone and four at once.

The results table holds ``--rows`` STARTED rows (a database of its own, ``bench_inflight``), spread over
``--nodes`` node names whose boots hold fresh leases (a heartbeat in this process) but that no worker
answers for, so a sweep that asks them waits its whole inspect timeout, as it would for busy ``-P solo``
workers. Each load is ``GET /admin/celery_orphans/orphanevent/in-flight/`` by a superuser through
Django's test client, in a process of its own; what it costs is its wall time and the CPU time of the
serving process, and of the machine over the whole round (PostgreSQL, Redis and whatever else runs on
it). Every round starts cold (verdicts an earlier round shared are dropped first), but for the last
``--rounds`` rounds, which follow at once and show what loads within the shared verdicts' lifetime cost.

    python benchmarks/inflight_page.py                  # 100,000 rows, 8 loads alone, 4 rounds of 4 at once
    python benchmarks/inflight_page.py --rows 10000 --quick
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "testproject")]
from benchmarks import results_table  # noqa: E402
from tests.services import BENCH_DATABASE_URL  # noqa: E402

DATABASE_URL = BENCH_DATABASE_URL.rsplit("/", 1)[0] + "/bench_inflight"
results_table.setup_django(DATABASE_URL)

from django.contrib.auth import get_user_model  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django.db import connections, transaction  # noqa: E402
from django.test import Client  # noqa: E402
from django.utils import timezone  # noqa: E402
from django_celery_results.models import TaskResult  # noqa: E402

from celery_orphans.worker.heartbeat import Heartbeat  # noqa: E402

PREFIX = "00000000-1f11-4000-8000-"
URL = "/admin/celery_orphans/orphanevent/in-flight/"


def build(rows: int, nodes: list[str]) -> None:
    TaskResult.objects.filter(task_id__startswith=PREFIX).delete()
    rng = random.Random(rows)
    now = timezone.now()
    with transaction.atomic(), results_table.copy_rows() as copy:
        for i in range(rows):
            worker = nodes[i % len(nodes)]
            began = now - timedelta(seconds=rng.uniform(60, 600))
            name = "demoapp.summarize" if i % 2 == 0 else "demoapp.scan"
            copy.write_row(results_table.started_row(f"{PREFIX}{i:012x}", name, worker, began, i))
    results_table.analyze()


def _cpu_of_machine() -> float:
    """Seconds of CPU spent by every process on the machine (user, nice, system), from /proc/stat."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    return (int(fields[0]) + int(fields[1]) + int(fields[2])) / os.sysconf("SC_CLK_TCK")


def load(_: int) -> tuple[float, float, int]:
    """One page load in this process: wall seconds, CPU seconds of this process, status."""
    connections.close_all()
    client = Client()
    client.force_login(get_user_model().objects.get(username="bench"))
    cpu, started = time.process_time(), time.monotonic()
    response = client.get(URL)
    return time.monotonic() - started, time.process_time() - cpu, response.status_code


def _drop_shared_verdicts() -> None:
    """Every round starts cold: no verdicts shared by an earlier load (the worst case for a round)."""
    try:
        from celery_orphans import inflight
    except ImportError:  # a version that shares none
        return
    inflight.forget()


def rounds(concurrency: int, count: int, *, cold: bool = True) -> dict[str, Any]:
    walls: list[float] = []
    cpus: list[float] = []
    machine = 0.0
    context = multiprocessing.get_context("fork")
    for _ in range(count):
        connections.close_all()
        if cold:
            _drop_shared_verdicts()
        before = _cpu_of_machine()
        with context.Pool(concurrency) as pool:
            results = pool.map(load, range(concurrency))
        machine += _cpu_of_machine() - before
        assert all(status == 200 for _, _, status in results), results
        walls += [wall for wall, _, _ in results]
        cpus += [cpu for _, cpu, _ in results]
    walls.sort()
    return {
        "loads": len(walls),
        "p50_s": round(statistics.median(walls), 2),
        "p95_s": round(walls[max(0, round(0.95 * len(walls)) - 1)], 2),
        "max_s": round(walls[-1], 2),
        "serving_cpu_s_per_load": round(statistics.mean(cpus), 2),
        "machine_cpu_s_per_load": round(machine / len(walls), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--nodes", type=int, default=10)
    parser.add_argument("--alone", type=int, default=8, help="loads one at a time")
    parser.add_argument("--rounds", type=int, default=4, help="rounds of --concurrency loads at once")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="2 loads alone, 1 round")
    args = parser.parse_args()
    if args.quick:
        args.alone, args.rounds = 2, 1
    call_command("migrate", verbosity=0)
    user, _ = get_user_model().objects.get_or_create(username="bench", defaults={"is_superuser": True})
    user.is_superuser = user.is_staff = True
    user.save()
    nodes = [f"celery@bench-inflight-{n}" for n in range(args.nodes)]
    print(f"building {args.rows:,} STARTED rows over {len(nodes)} nodes", flush=True)
    build(args.rows, nodes)
    beats = [Heartbeat(node) for node in nodes]
    for beat in beats:
        beat.take()
        beat.start()
    try:
        alone = rounds(1, args.alone)
        together = rounds(args.concurrency, args.rounds)
        # Right after a cold round: the loads a viewer makes within the shared verdicts' few seconds.
        warm = rounds(args.concurrency, args.rounds, cold=False)
    finally:
        for beat in beats:
            beat.stop()
    at_once = f"{args.concurrency}_at_once"
    found = {"rows": args.rows, "alone": alone, at_once: together, f"{at_once}_warm": warm}
    print(json.dumps(found, indent=2))


if __name__ == "__main__":
    main()
