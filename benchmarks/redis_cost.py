"""What the leases, the watch and a sweep with nothing to do cost Redis, with the default timings.

The ledger lives on a ``redis-server`` of its own (the broker on another), so every command it serves is
celery-orphans': its ``INFO commandstats`` and CPU time, read before and after, are the cost.

- **Idle real workers**: ``--workers`` workers with the default settings (heartbeat, lease, the watch)
  and no task, for ``--seconds``: round trips and commands per second per worker (a round trip is one
  script call; the commands are what it runs inside Redis).
- **1,000 idle workers, simulated**: ``--leases`` heartbeats in this process, four to a machine, each
  renewing its lease with the real renewal script on the default heartbeat, for ``--seconds``: round
  trips and commands per second, and Redis's CPU time per second of it.
- **A sweep with nothing to do**: one sweep (as Beat's) over those leases and no task: its Redis
  commands on the ledger, and the broadcasts it sent on the broker (must be none).

    python benchmarks/redis_cost.py
    python benchmarks/redis_cost.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "testproject")]
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "testproject.settings")
from tests.services import provide_with_ledger_apart  # noqa: E402

TMP, LEDGER_URL = provide_with_ledger_apart("redis-cost")
os.environ["CELERY_ORPHANS_ENABLED"] = "true"

import django  # noqa: E402

django.setup()

# isort: split
import redis  # noqa: E402
from django.core.management import call_command  # noqa: E402

from celery_orphans import sweep  # noqa: E402
from celery_orphans.choices import Trigger  # noqa: E402
from celery_orphans.conf import settings  # noqa: E402
from celery_orphans.processes import Process  # noqa: E402
from celery_orphans.worker.heartbeat import Heartbeat  # noqa: E402
from tests.workers import OWN_SWEEPS_ON, WorkerPool  # noqa: E402

PER_MACHINE = 4


def stats(conn: redis.Redis[bytes]) -> dict[str, float]:
    """Commands served by name, round trips (script calls and plain commands), and CPU seconds."""
    commands = conn.info("commandstats")
    cpu = conn.info("cpu")
    calls = {name.removeprefix("cmdstat_"): float(v["calls"]) for name, v in commands.items()}
    return {**calls, "_cpu": float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])}


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {
        k: after.get(k, 0.0) - before.get(k, 0.0) for k in after if after.get(k, 0.0) != before.get(k, 0.0)
    }


def rates(counted: dict[str, float], seconds: float, per: int) -> dict[str, Any]:
    ours = {
        k: v for k, v in counted.items() if not k.startswith("_") and not k.startswith(("info", "config"))
    }
    trips = sum(v for k, v in ours.items() if k in {"evalsha", "eval"} or k not in _SCRIPTED)
    return {
        "round_trips_per_second": trips / seconds / per,
        "commands_per_second": sum(ours.values()) / seconds / per,
        "by_command": {k: round(v / seconds / per, 3) for k, v in sorted(ours.items())},
        "redis_cpu_share": counted.get("_cpu", 0.0) / seconds,
    }


# What the renewal and claim scripts run inside Redis: counted as commands, not as round trips.
_SCRIPTED = {"time", "set", "hset", "zadd", "zrangebyscore", "pexpire", "hgetall", "zscore", "zrem", "hget"}


def idle_workers(count: int, seconds: float, ledger: redis.Redis[bytes]) -> dict[str, Any]:
    pool = WorkerPool(TMP, dict(os.environ))
    try:
        for i in range(count):
            pool.start(f"idle-{i}@bench", env=OWN_SWEEPS_ON)
        time.sleep(2 * settings.HEARTBEAT_SECONDS)
        before = stats(ledger)
        time.sleep(seconds)
        return rates(delta(before, stats(ledger)), seconds, count)
    finally:
        pool.close()


def simulated(
    count: int, seconds: float, ledger: redis.Redis[bytes]
) -> tuple[dict[str, Any], list[Heartbeat]]:
    """``count`` heartbeats renewing on the default beat, four to a (pretend) machine, from one thread."""
    seen: list[object] = []
    beats = []
    for i in range(count):
        beat = Heartbeat(f"sim-{i}@bench", on_renewed=seen.append)
        beat.process = Process(f"bench-machine-{i // PER_MACHINE}", 100 + i, 1)
        beats.append(beat)
    for beat in beats:
        beat.renew()
    interval = settings.HEARTBEAT_SECONDS
    stop = threading.Event()

    def renewing() -> None:
        # Each heartbeat renews once per interval, spread evenly over it, as independent workers do.
        started = time.monotonic()
        n = 0
        while not stop.is_set():
            due = started + n * interval / count
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            beats[n % count].renew()
            n += 1

    thread = threading.Thread(target=renewing, daemon=True)
    thread.start()
    time.sleep(interval)
    before = stats(ledger)
    time.sleep(seconds)
    after = stats(ledger)
    stop.set()
    thread.join()
    return rates(delta(before, after), seconds, 1), beats


def empty_sweep(ledger: redis.Redis[bytes], broker: redis.Redis[bytes]) -> dict[str, Any]:
    sweep.run(sweep.Options(trigger=Trigger.COMMAND))  # warm: scripts loaded, tasks imported
    before, broker_before = stats(ledger), stats(broker)
    started = time.monotonic()
    report = sweep.run(sweep.Options(trigger=Trigger.COMMAND))
    took = time.monotonic() - started
    counted, on_broker = delta(before, stats(ledger)), delta(broker_before, stats(broker))
    ours = {
        k: v for k, v in counted.items() if not k.startswith("_") and not k.startswith(("info", "config"))
    }
    return {
        "seconds": took,
        "candidates": len(report.outcomes),
        "redis_commands": int(sum(ours.values())),
        "by_command": {k: int(v) for k, v in sorted(ours.items())},
        "broadcasts": int(on_broker.get("publish", 0)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="CI size: fewer seconds and leases")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--leases", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "redis_cost.json")
    args = parser.parse_args()
    if args.quick:
        args.seconds, args.leases = 6.0, 200
    call_command("migrate", verbosity=0)
    ledger = redis.Redis.from_url(LEDGER_URL)
    broker = redis.Redis.from_url(os.environ["CELERY_BROKER_URL"])

    print(f"{args.workers} idle workers for {args.seconds:g}s ...", flush=True)
    workers = idle_workers(args.workers, args.seconds, ledger)
    print(f"{args.leases} simulated idle workers for {args.seconds:g}s ...", flush=True)
    many, beats = simulated(args.leases, args.seconds, ledger)
    print("a sweep with nothing to do ...", flush=True)
    idle_sweep = empty_sweep(ledger, broker)
    for beat in beats:
        beat.stop()
    results = {
        "heartbeat_seconds": settings.HEARTBEAT_SECONDS,
        "idle_worker": workers,
        "idle_workers_simulated": {"leases": args.leases, **many},
        "sweep_with_nothing_to_do": {"leases": args.leases, **idle_sweep},
    }
    print(
        f"\nper idle worker: {workers['round_trips_per_second']:.2f} round trips/s, "
        f"{workers['commands_per_second']:.2f} commands/s\n"
        f"{args.leases} idle workers: {many['round_trips_per_second']:.0f} round trips/s, "
        f"{many['commands_per_second']:.0f} commands/s, Redis CPU {many['redis_cpu_share']:.1%}\n"
        f"a sweep with nothing to do: {idle_sweep['redis_commands']} Redis commands, "
        f"{idle_sweep['broadcasts']} broadcasts, {idle_sweep['seconds']:.3f}s"
    )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
