"""The lease's trade-off: for each ``LEASE_SECONDS`` (the heartbeat a fifth of it, as by default), three
figures an operator weighs against each other.

- **A worker alone in its container, never back**: a worker in a pid namespace of its own (``unshare``)
  is SIGKILLed mid-task; time from the kill until the task's re-run starts on a live worker, whose watch
  sees the lease lapse (no Beat runs). The kills are spread over a heartbeat.
- **The longest Redis stall a live worker rides through**: the ledger's ``redis-server`` is stopped
  (SIGSTOP) for a while and continued, the stall beginning 0.05 s before the idle worker's next renewal
  is due (the worst moment). The worker rode through if it kept its boot (no "gives up its boot" in its
  log) and its validity held all along: its first renewal after the stall ran, in Redis's time, within
  ``LEASE_SECONDS`` less the forfeit's margin (``settings.lease_margin()``: a heartbeat, the clock skew
  and the forfeit's latency) of the one before. The length is bisected: ``rides`` is the longest stall
  ridden, ``forfeits`` the shortest that was not.
- **Redis commands per idle worker per second**: the ledger on a server of its own with one idle worker,
  counted by Redis (``INFO commandstats``, the scripts' own commands included) over whole heartbeats.

It writes ``benchmarks/results/lease_tradeoff.json`` and, with matplotlib (the ``bench`` extra), the
picture (``benchmarks/results/lease-tradeoff.png``), and prints the table under it; the deployment
guide shows both.

    python benchmarks/lease_tradeoff.py                 # leases 2.5, 5, 10, 20 s; about 9 minutes
    python benchmarks/lease_tradeoff.py --image docs/img/lease-tradeoff.png   # the guide's picture
    python benchmarks/lease_tradeoff.py --quick         # leases 2.5 and 10 s, one trial each
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "testproject")]
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "testproject.settings")
from tests.services import provide_with_ledger_apart  # noqa: E402

# The recovery benchmark's database (it deletes every result row there), the ledger on a server of its own.
TMP, LEDGER_URL = provide_with_ledger_apart(
    "lease-tradeoff",
    os.environ.get("BENCH_RECOVERY_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/bench_recovery"),
)
os.environ["CELERY_ORPHANS_ENABLED"] = "true"

import django  # noqa: E402

django.setup()

# isort: split
import redis  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django.test import override_settings  # noqa: E402
from django_celery_results.models import TaskResult  # noqa: E402

from benchmarks.figures import counters, per_task  # noqa: E402
from benchmarks.recovery_time import ELSEWHERE, elsewhere_possible, never_back, summary  # noqa: E402
from celery_orphans.conf import settings  # noqa: E402
from celery_orphans.store import Keys  # noqa: E402
from tests.helpers import wait_for  # noqa: E402
from tests.workers import OWN_SWEEPS_ON, Worker, WorkerPool  # noqa: E402

LEASES = [2.5, 5.0, 10.0, 20.0]
QUICK_LEASES = [2.5, 10.0]
IMAGE = ROOT / "benchmarks" / "results" / "lease-tradeoff.png"
FORFEIT_LINE = "gives up its boot"
DEFAULT_LEASE = 10.0
EARLY = 0.05  # the stall begins this long before the next renewal is due


def settings_env(lease: float) -> dict[str, str]:
    return {
        **OWN_SWEEPS_ON,
        "CELERY_ORPHANS_LEASE_SECONDS": f"{lease:g}",
        "CELERY_ORPHANS_HEARTBEAT_SECONDS": f"{lease / 5:g}",
        # The lease's own trade-off: a worker's presence would tell of the container's death sooner.
        "CELERY_ORPHANS_PRESENCE": "false",
    }


def last_renewal(ledger: redis.Redis[bytes], node: str) -> float:
    """When the newest boot of ``node`` last renewed, in Redis's time (seconds since the epoch)."""
    records = ledger.hgetall(Keys.current().boots(node)).values()
    return max((int(r.split(b":")[0]) for r in records), default=0) / 1000


def next_renewal(ledger: redis.Redis[bytes], node: str, heartbeat: float) -> float:
    """Wait for ``node``'s next renewal; when it was."""
    before = last_renewal(ledger, node)
    return float(  # type: ignore[arg-type]
        wait_for(
            lambda: last_renewal(ledger, node) > before and last_renewal(ledger, node), 3 * heartbeat + 10
        )
    )


def idle_commands(
    ledger: redis.Redis[bytes], node: str, heartbeat: float, beats: int = 3
) -> dict[str, float]:
    """Commands and calls per second of one idle worker, over ``beats`` whole heartbeats."""
    next_renewal(ledger, node, heartbeat)
    before = counters(ledger.info("commandstats"), ledger.info("cpu"), ledger.info("stats"))
    time.sleep((beats + 0.5) * heartbeat)  # the renewals that follow, and none of the next
    after = counters(ledger.info("commandstats"), ledger.info("cpu"), ledger.info("stats"))
    cost = per_task(before, after, beats)  # per renewal
    return {
        "commands_per_second": cost["commands_per_task"] / heartbeat,
        "calls_per_second": cost["calls_per_task"] / heartbeat,
        "commands_per_renewal": cost["commands_per_task"],
    }


def rides_through(
    worker: Worker, ledger: redis.Redis[bytes], server_pid: int, lease: float, stall: float
) -> dict[str, bool]:
    """Stop the ledger's Redis for ``stall`` seconds from just before a renewal is due; whether the
    worker kept its boot, and whether its fence held all along."""
    heartbeat = lease / 5
    forfeits = worker.log().count(FORFEIT_LINE)
    renewed = next_renewal(ledger, worker.name, heartbeat)
    time.sleep(max(0.0, renewed + heartbeat - EARLY - time.time()))
    began = time.time()  # Redis runs nothing from now until it is continued
    os.kill(server_pid, signal.SIGSTOP)
    try:
        time.sleep(stall)
    finally:
        os.kill(server_pid, signal.SIGCONT)
    wait_for(
        lambda: last_renewal(ledger, worker.name) > began, 3 * heartbeat + 10, "a renewal after the stall"
    )
    gap = last_renewal(ledger, worker.name) - renewed
    with override_settings(CELERY_ORPHANS_LEASE_SECONDS=lease, CELERY_ORPHANS_HEARTBEAT_SECONDS=heartbeat):
        validity = lease - settings.lease_margin()
    # The renewal after it may come at the instant its predecessor's validity ends, and give the boot up.
    next_renewal(ledger, worker.name, heartbeat)
    return {
        "boot_kept": worker.log().count(FORFEIT_LINE) == forfeits,
        "fence_held": gap < validity,
        "renewals_apart_s": gap,
    }


def longest_stall(pool: WorkerPool, ledger: redis.Redis[bytes], lease: float, probes: int) -> dict[str, Any]:
    """The longest stall ridden through and the shortest not, bisected in ``probes`` stalls."""
    heartbeat = lease / 5
    worker = pool.start(f"stall-{lease:g}@bench", env=settings_env(lease))
    try:
        idle = idle_commands(ledger, worker.name, heartbeat)
        server_pid = int(ledger.info("server")["process_id"])
        rides, forfeits = 0.0, 1.2 * lease  # past the lease, Redis itself lets the lease key lapse
        low, high = 0.0, 1.2 * lease
        probed: list[dict[str, Any]] = []
        for _ in range(probes):
            stall = (low + high) / 2
            seen = rides_through(worker, ledger, server_pid, lease, stall)
            kept = seen["boot_kept"] and seen["fence_held"]
            print(
                f"    lease {lease:g}s: a {stall:.2f}s stall {'ridden through' if kept else 'forfeit'} "
                f"(boot kept: {seen['boot_kept']}, fence held: {seen['fence_held']}; renewals "
                f"{seen['renewals_apart_s']:.2f}s apart)",
                flush=True,
            )
            probed.append({"stall_s": stall, **seen})
            if kept:
                low = rides = stall
            else:
                high = forfeits = stall
        return {"rides_s": rides, "forfeits_s": forfeits, "stalls": probed, **idle}
    finally:
        worker.stop()


def measure(
    pool: WorkerPool, ledger: redis.Redis[bytes], lease: float, trials: int, probes: int
) -> dict[str, Any]:
    print(f"  lease {lease:g}s, heartbeat {lease / 5:g}s", flush=True)
    stall = longest_stall(pool, ledger, lease, probes)
    container = never_back(
        pool,
        trials,
        random.Random(int(lease * 10)),
        f"lease-{lease:g}",
        ELSEWHERE,
        env=settings_env(lease),
        interval=lease / 5,
    )
    return {"lease_s": lease, "heartbeat_s": lease / 5, "container_never_back": summary(container), **stall}


def table(rows: list[dict[str, Any]]) -> str:
    """The Markdown table the deployment guide shows under the picture."""
    lines = [
        "| `LEASE_SECONDS` | `HEARTBEAT_SECONDS` | container, never back: p50 (max) "
        "| longest Redis stall ridden through | Redis commands per idle worker per second |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        c = r["container_never_back"]
        lines.append(
            f"| {r['lease_s']:g} | {r['heartbeat_s']:g} | {c['p50']:.1f} s ({c['max']:.1f} s, n={c['n']}) "
            f"| {r['rides_s']:.1f} s (not {r['forfeits_s']:.1f} s) | {r['commands_per_second']:.1f} |"
        )
    return "\n".join(lines)


def picture(rows: list[dict[str, Any]], path: Path) -> bool:
    """Draw the three figures against the lease; ``False`` without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    leases = [r["lease_s"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    left.plot(
        leases,
        [r["container_never_back"]["p50"] for r in rows],
        "o-",
        label="recovery, container never back (p50)",
    )
    left.fill_between(
        leases,
        [r["container_never_back"]["min"] for r in rows],
        [r["container_never_back"]["max"] for r in rows],
        alpha=0.2,
        label="its min to max",
    )
    left.errorbar(
        leases,
        [r["rides_s"] for r in rows],
        yerr=[[0.0] * len(rows), [r["forfeits_s"] - r["rides_s"] for r in rows]],
        fmt="s-",
        capsize=3,
        label="longest Redis stall a live worker rides through\n(bar: up to the shortest it did not)",
    )
    left.set(xlabel="LEASE_SECONDS (HEARTBEAT_SECONDS = a fifth)", ylabel="seconds", title="Time")
    left.grid(alpha=0.3)
    left.legend(fontsize=8, loc="upper left")
    right.plot(leases, [r["commands_per_second"] for r in rows], "^-", color="tab:red")
    right.set(
        xlabel="LEASE_SECONDS (HEARTBEAT_SECONDS = a fifth)",
        ylabel="Redis commands per second",
        title="Redis cost of one idle worker",
    )
    right.set_ylim(bottom=0)
    right.grid(alpha=0.3)
    left.set_ylim(0, 1.35 * max(r["container_never_back"]["max"] for r in rows))  # room for the legend
    for axes in (left, right):
        axes.set_xticks(leases)
        axes.axvline(DEFAULT_LEASE, color="grey", linestyle=":", linewidth=1)
        axes.annotate("default", (DEFAULT_LEASE, 0), xytext=(3, 3), textcoords="offset points", color="grey")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="two leases, one trial, three stalls each")
    parser.add_argument("--leases", help="comma-separated LEASE_SECONDS values")
    parser.add_argument("--trials", type=int, default=4, help="container trials per lease")
    parser.add_argument("--probes", type=int, default=5, help="stalls per lease (bisection steps)")
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "lease_tradeoff.json")
    parser.add_argument("--image", type=Path, default=IMAGE)
    parser.add_argument("--draw", type=Path, help="only draw the picture of an earlier run's JSON")
    args = parser.parse_args()
    if args.draw:
        picture(json.loads(args.draw.read_text())["rows"], args.image)
        return
    leases = (
        [float(x) for x in args.leases.split(",")] if args.leases else QUICK_LEASES if args.quick else LEASES
    )
    if args.quick:
        args.trials, args.probes = 1, 3
    if not elsewhere_possible():
        sys.exit("unshare cannot make a pid namespace here: no worker can be alone in its container")

    call_command("migrate", verbosity=0)
    TaskResult.objects.all().delete()
    ledger = redis.Redis.from_url(LEDGER_URL)
    pool = WorkerPool(TMP, {**os.environ, "PYTHONPATH": str(ROOT)})
    started = time.monotonic()
    print(f"load {os.getloadavg()[0]:.2f}", flush=True)
    try:
        rows = [measure(pool, ledger, lease, args.trials, args.probes) for lease in leases]
    finally:
        pool.close()
    results = {
        "rows": rows,
        "seconds": time.monotonic() - started,
        "load": os.getloadavg()[0],
        "stall_begins_before_renewal_s": EARLY,
    }
    drawn = picture(rows, args.image)
    print(f"\n{table(rows)}\n")
    print(f"{results['seconds']:.0f} s, load {results['load']:.2f}")
    print(f"picture: {args.image}" if drawn else "no picture: pip install -e '.[bench]' for matplotlib")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
