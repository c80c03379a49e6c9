"""Run every benchmark, then print one table: each target, the measured value, PASS or FAIL.

    python benchmarks/run.py            # full size (under ten minutes on two cores)
    python benchmarks/run.py --quick    # CI size (under two minutes), every figure still printed
    python benchmarks/run.py --only sweep_scale,throughput
    python benchmarks/run.py --only lease_tradeoff   # the lease's trade-off, not in the full run

From a fresh clone it sets itself up first: the virtualenv and the services the tests use
(``tests/setup-env.sh``; it then runs again inside that virtualenv) and the benchmarks' own database.
Each benchmark runs in its own process and writes its raw results as JSON; this script gathers them into
``benchmarks/results/summary.json`` with the machine's load average around each one. It exits 1 when a
target is missed or a benchmark fails, 0 otherwise. Figures without a target are printed as ``info``;
a target not judged at ``--quick`` size is ``n/a``. Each row carries the 1-minute load average before and
after the benchmark that measured it, since the machine may be shared.

Recovery time (P1, P2) and ledger hygiene (P5) run inside the sweep benchmark's process time, while the
ping-per-worker reference pings one worker after another: those pings spend three minutes waiting out
1 s timeouts, which other work on the machine does not lengthen. P5 starts once P1's worker restarts are
over. The reference's row queries and every sweep of ours are timed only once
both have ended, and throughput (P4) runs alone.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
HERE = ROOT / "benchmarks"

Row = tuple[str, str, str, str]  # benchmark, target, measured, result


@dataclass(frozen=True)
class Benchmark:
    name: str
    script: str
    full: list[str]
    quick: list[str]
    rows: Callable[[dict[str, Any]], list[Row]]
    by_default: bool = True  # else only when named in --only


def verdict(passed: bool | None) -> str:
    return "n/a" if passed is None else "PASS" if passed else "FAIL"


def checks(data: dict[str, Any]) -> list[Row]:
    return [(c["benchmark"], c["target"], c["measured"], verdict(c["pass"])) for c in data["checks"]]


RECOVERY_LABELS = {
    "P1_default_flags_from_kill": "P1 same-name restart, default flags, from the kill",
    "P1_default_flags_from_ready": "P1 same-name restart, default flags, from ready",
    "P1_lean_flags_from_kill": "P1 same-name restart, lean flags, from the kill",
    "P1_lean_flags_from_ready": "P1 same-name restart, lean flags, from ready",
    "P2_default_flags": "P2 never back, same machine, default flags",
    "P2_lean_flags": "P2 never back, same machine, lean flags",
    "P2b_never_back_not_seen": "P2b never back, alone in its container",
}


def recovery_rows(data: dict[str, Any]) -> list[Row]:
    rows = []
    for name, r in data.items():
        label = RECOVERY_LABELS.get(name, name)
        # The time after ready is judged in hundredths of a second.
        digits = 2 if name.endswith("_from_ready") or r["p95"] < 1 else 1
        measured = (
            f"p50 {r['p50']:.{digits}f} s, p95 {r['p95']:.{digits}f} s, max {r['max']:.{digits}f} s "
            f"(n={r['n']})"
        )
        rows.append((label, r["target"], measured, verdict(r["pass"])))
    return rows


def sweep_rows(data: dict[str, Any]) -> list[Row]:
    h = data["headline"]
    rows = checks(data)
    rows.insert(
        1,
        (
            "P3 reference, same data",
            "info",
            f"{h['reference']:.1f} s ({h['reference_decisions']['workers_pinged']} pings, "
            f"{h['reference_phases']['ping']:.1f} s of them)",
            "info",
        ),
    )
    rows.append(
        (
            "P3 setting",
            "info",
            f"{h['rows']:,} STARTED rows, {data['finished_rows']:,} finished; "
            f"{h['live']} live + {h['dead']} dead workers",
            "info",
        )
    )
    phases = ", ".join(f"{k} {v:.2f}" for k, v in h["ours_phases"].items())
    rows.append(("P3 dry run, where the time goes", "info", phases + " s", "info"))
    silent = data.get("silent_dead")
    if silent:
        # Not the P3 target's case: a silent node is asked, and its silence waited out once (see the README).
        phases = ", ".join(f"{k} {v:.2f}" for k, v in silent["phases"].items())
        rows.append(
            (
                "P3 dry run, dead silent (answer needed)",
                f"info: waits {silent['inspect_timeout_seconds']:g} s",
                f"{silent['dry_median']:.2f} s ({phases} s)",
                "info",
            )
        )
    for n, figure in data["by_rows"].items():
        rows.append((f"P3 dry run, {int(n):,} rows", "grows with rows", f"{figure['median']:.2f} s", "info"))
    for label, seconds in data["dead_workers"].items():
        rows.append((f"P3 dry run, {label.replace('_', ' ')}", "flat in dead", f"{seconds:.2f} s", "info"))
    real = data["real"]
    rows.append(
        (
            "P3 real sweep",
            "info",
            f"{real['median']:.1f} s ({real['decisions'].get('done', 0):,} actions, "
            f"{real.get('rows', h['rows']):,} STARTED rows)",
            "info",
        )
    )
    revokes = real.get("revokes_handled_by_live_workers_seconds")
    if revokes:
        rows.append(("P3 live workers handle revokes", "info", f"{max(revokes):.1f} s after it", "info"))
    for dead_as, sweeps in data.get("real_twice", {}).items():
        rows.append(
            (
                f"P3 two real sweeps, dead {dead_as.replace('_', ' ')}",
                "info",
                "; ".join(
                    f"sweep {r['sweep']}: {r['seconds']:.2f} s, broadcast {r['phases']['broadcast']:.2f} s, "
                    f"{r['decisions'].get('done', 0):,} actions"
                    for r in sweeps
                ),
                "info",
            )
        )
    for label, plan in data["explain"].items():
        scan = "seq scan" if plan["seq_scan"] else "index: " + ", ".join(plan["indexes"])
        rows.append(
            (
                f"P3 EXPLAIN, {label.replace('_', ' ')}",
                "no seq scan",
                f"{plan['execution_ms']:.1f} ms, {scan}",
                verdict(not plan["seq_scan"]),
            )
        )
    workers = data["workers"]
    rows.append(
        (
            "P3 live workers' memory",
            "info",
            f"{workers['started']} of {workers['wanted']}, {workers['total_mb']:.0f} MB",
            "info",
        )
    )
    return rows


def throughput_rows(data: dict[str, Any]) -> list[Row]:
    rows = checks(data)
    for kind in ("noop", "sleep10ms"):
        r = data[kind]
        rows.append(
            (
                f"P4 {kind} tasks/s",
                "info",
                f"plain {r['plain']:.0f}, ours {r['ours']:.0f} ({r['batch']} of each per trial, "
                f"{len(r['plain_runs'])} trials, ratio of the medians {r['ratio_of_medians']:.1%}, "
                f"worker CPU {r['cpu_ms_per_task']:.2f} ms/task)",
                "info",
            )
        )
    for label, hook in data.get("hooks", {}).items():
        rows.append((f"P4 hook: {label}", "info", f"mean {hook['mean_ms']:.2f} ms per task", "info"))
    rows.append(
        (
            "P4 ledger entries left",
            "0",
            str(data["ledger_entries_left"]),
            verdict(data["ledger_entries_left"] == 0),
        )
    )
    return rows


def hygiene_rows(data: dict[str, Any]) -> list[Row]:
    rows = checks(data)
    after = data["after"]
    rows.append(
        (
            "P5 setting",
            "info",
            f"{data['tasks']:,} tasks in {data['seconds']:.0f} s, ended {data['outcomes']}",
            "info",
        )
    )
    rows.append(
        (
            "P5 ledger Redis used_memory",
            "info",
            f"{data['before']['used_memory']:,} -> {after['used_memory']:,} B "
            f"(client buffers {after['clients_memory']:,} B)",
            "info",
        )
    )
    return rows


def redis_cost_rows(data: dict[str, Any]) -> list[Row]:
    one, many, idle = data["idle_worker"], data["idle_workers_simulated"], data["sweep_with_nothing_to_do"]
    return [
        (
            "Redis, per idle worker",
            "info",
            f"{one['round_trips_per_second']:.2f} round trips/s, {one['commands_per_second']:.1f} commands/s",
            "info",
        ),
        (
            f"Redis, {many['leases']:,} idle workers (simulated)",
            "info",
            f"{many['round_trips_per_second']:,.0f} round trips/s, {many['commands_per_second']:,.0f} "
            f"commands/s, Redis CPU {many['redis_cpu_share']:.1%}",
            "info",
        ),
        (
            "Redis, a sweep with nothing to do",
            "no broadcast",
            f"{idle['redis_commands']} commands, {idle['broadcasts']} broadcasts, "
            f"{idle['seconds'] * 1000:.0f} ms",
            verdict(idle["broadcasts"] == 0),
        ),
    ]


def ledger_ceiling_rows(data: dict[str, Any]) -> list[Row]:
    ledger, broker = data["ledger"], data["broker"]

    def spread(figure: dict[str, float]) -> str:
        return f"{figure['median']:,.0f} (min {figure['min']:,.0f}, max {figure['max']:,.0f})"

    def cost(r: dict[str, Any]) -> str:
        return (
            f"{r['commands_per_task']['median']:.0f} commands in {r['calls_per_task']['median']:.0f} calls, "
            f"{r['bytes_in_per_task']['median']:,.0f} B in, {r['bytes_out_per_task']['median']:,.0f} B out, "
            f"{r['redis_cpu_us_per_task']['median']:.1f} us of Redis CPU at "
            f"{r['wall_tasks_per_second']['median']:,.0f} tasks/s "
            f"({r['redis_cpu_share']['median']:.0%} of a core)"
        )

    headline = ledger[data["headline"]]
    rows: list[Row] = [
        (
            "Ledger ceiling, tasks per Redis-core-second",
            f">= {data['target_tasks_per_core_second']:,}",
            f"{spread(headline['tasks_per_core_second'])} ({data['headline']})",
            verdict(data["pass"]),
        ),
    ]
    for label in [name for name in ledger if ", depth " in name]:
        rows.append((f"Ledger per task, {label}", "info", cost(ledger[label]), "info"))
    rows.append(("Broker per task (publish, consume, ack)", "info", cost(broker), "info"))
    rows.append(
        (
            "Ledger entry",
            "info",
            f"{ledger['entry_json_bytes']:,} B of JSON, {ledger['memory_per_entry_bytes']:,.0f} B of Redis "
            f"memory while its task runs; {ledger['entries_left']} left after the runs",
            verdict(ledger["entries_left"] == 0),
        )
    )
    return rows


def liveness_rows(data: dict[str, Any]) -> list[Row]:
    def ms(figure: dict[str, float]) -> str:
        low, mid, high = (figure[k] * 1000 for k in ("min", "median", "max"))
        return f"median {mid:.2f} ms (min {low:.2f}, max {high:.2f}, n={figure['n']:.0f})"

    rows: list[Row] = []
    for mb in (0, 100, 1000):
        if f"pidfd_{mb}mb" in data:
            rows.append(
                (f"pidfd readable after SIGKILL, {mb} MB held", "info", ms(data[f"pidfd_{mb}mb"]), "info")
            )
    for kind in ("subscribe", "blpop", "named"):
        rows.append((f"Redis drops a SIGKILLed {kind} client", "info", ms(data[f"redis_{kind}"]), "info"))
    cut = data.get("cut_off")
    if cut:

        def after(seconds: float | None, observed: float) -> str:
            return f"kept for {observed:g} s, all it was watched" if seconds is None else f"{seconds:.2f} s"

        rows += [
            (
                "Redis drops a client cut off by the network",
                "info",
                f"tcp-keepalive 300: {after(cut['default_keepalive_dropped_after_s'], cut['observed_s'])}; "
                "SIGKILLed behind the cut: "
                f"{after(cut['killed_behind_cut_dropped_after_s'], cut['observed_s'])}; "
                f"tcp-keepalive 3: {after(cut['keepalive_3_dropped_after_s'], 20)}",
                "info",
            ),
        ]
        if cut.get("reset_available"):
            rows.append(
                (
                    "Redis's side reset, the client cut off",
                    "info",
                    f"Redis drops it at once; the client "
                    f"{'never hears of it' if cut['subscriber_unaware_after_restore'] else 'hears of it'} "
                    "until it sends",
                    "info",
                )
            )
    return rows


def lease_tradeoff_rows(data: dict[str, Any]) -> list[Row]:
    rows: list[Row] = []
    for r in data["rows"]:
        c = r["container_never_back"]
        rows.append(
            (
                f"Lease {r['lease_s']:g} s, heartbeat {r['heartbeat_s']:g} s",
                "info",
                f"container never back p50 {c['p50']:.1f} s (max {c['max']:.1f} s, n={c['n']}); "
                f"rides a {r['rides_s']:.1f} s Redis stall (not {r['forfeits_s']:.1f} s); "
                f"{r['commands_per_second']:.1f} Redis commands/s per idle worker",
                "info",
            )
        )
    return rows


# Full size: 10 trials of P1 and of P2 with each flag set (Celery's default, the lean ones); 8 of P2b,
# judged against its 5 s target like the others (its presence tells, a heartbeat before its lease's end).
RECOVERY_FULL = ["--trials", "10", "--p2b-trials", "8"]
RECOVERY_QUICK = ["--trials", "1", "--p2b-trials", "1"]

# Run while the P3 reference pings one worker after another (see the docstring); P5 once P1's worker
# restarts are over.
ALONGSIDE_REFERENCE = ("recovery_time", "hygiene")

BENCHMARKS = [
    Benchmark("recovery_time", "recovery_time.py", RECOVERY_FULL, RECOVERY_QUICK, recovery_rows),
    Benchmark("sweep_scale", "sweep_scale.py", [], ["--quick"], sweep_rows),
    Benchmark("throughput", "throughput.py", [], ["--quick"], throughput_rows),
    Benchmark("hygiene", "hygiene.py", [], ["--quick"], hygiene_rows),
    Benchmark("redis_cost", "redis_cost.py", [], ["--quick"], redis_cost_rows),
    Benchmark("ledger_ceiling", "ledger_ceiling.py", [], ["--quick"], ledger_ceiling_rows),
    Benchmark("liveness_signals", "liveness_signals.py", [], ["--quick"], liveness_rows),
    # Eight minutes more, waiting out leases up to 20 s: run it with --only lease_tradeoff.
    Benchmark("lease_tradeoff", "lease_tradeoff.py", [], ["--quick"], lease_tradeoff_rows, by_default=False),
]


def command_of(bench: Benchmark, quick: bool, out: Path) -> list[str]:
    sizes = bench.quick if quick else bench.full
    return [sys.executable, str(HERE / bench.script), *sizes, "--json", str(out)]


def run(bench: Benchmark, quick: bool, out: Path, extra: list[str] | None = None) -> dict[str, Any]:
    print(f"\n=== {bench.name} ===", flush=True)
    command = command_of(bench, quick, out) + (extra or [])
    before, started = os.getloadavg(), time.monotonic()
    code = subprocess.call(command, cwd=ROOT, env=dict(os.environ))
    record: dict[str, Any] = {
        "command": " ".join(command[1:]),
        "exit_code": code,
        "seconds": time.monotonic() - started,
        "load_before": before,
        "load_after": os.getloadavg(),
    }
    if code == 0 and out.exists():
        record["results"] = json.loads(out.read_text())
    return record


def run_alongside(
    host: Benchmark, guests: list[Benchmark], quick: bool, tmp: Path
) -> dict[str, dict[str, Any]]:
    """Run ``guests`` from inside ``host``'s process while host's reference pings (see the docstring)."""
    specs = []
    p1_done = tmp / "p1.done"
    for guest in guests:
        command = command_of(guest, quick, tmp / f"{guest.name}.json")
        if guest.name == "recovery_time":
            command += ["--p1-done", str(p1_done)]
        elif guest.name == "hygiene":
            # Once P1 is over (waiting ten minutes at most).
            wait = f"for _ in $(seq 1200); do [ -e {p1_done} ] && break; sleep 0.5; done"
            command = ["bash", "-c", f'{wait}; exec "$@"', "hygiene", *command]
        spec = tmp / f"{guest.name}.alongside.json"
        spec.write_text(
            json.dumps(
                {
                    "name": guest.name,
                    "command": command,
                    "env": dict(os.environ),
                    "log": str(tmp / f"{guest.name}.log"),
                }
            )
        )
        specs += ["--alongside", str(spec)]
    records = {host.name: run(host, quick, tmp / f"{host.name}.json", specs)}
    beside = (records[host.name].get("results") or {}).get("alongside") or {}
    for guest in guests:
        print(f"\n=== {guest.name} (ran alongside {host.name}'s reference) ===", flush=True)
        print(_read(tmp / f"{guest.name}.log"), flush=True)
        ran = beside.get(guest.name) or {}
        out = tmp / f"{guest.name}.json"
        records[guest.name] = {
            "command": " ".join(command_of(guest, quick, out)[1:]),
            "exit_code": ran.get("exit_code", 1),
            "seconds": ran.get("seconds", 0.0),
            "alongside": host.name,
            "load_before": records[host.name]["load_before"],
            "load_after": records[host.name]["load_after"],
        }
        if records[guest.name]["exit_code"] == 0 and out.exists():
            records[guest.name]["results"] = json.loads(out.read_text())
    return records


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else "(no output)"


def ensure_setup() -> None:
    """A fresh clone: the virtualenv and services (tests/setup-env.sh), then this script inside it."""
    found = subprocess.run(
        ["bash", "-c", 'source tests/setup-env.sh && setup_env >&2 && printf %s "$VENV"'],
        cwd=ROOT,
        # The install the docs recommend for workers: with redis-py's C parser, for both task sets; and
        # py-spy, for the stacks recovery_time.py shows when a re-run never comes.
        env={"EXTRAS": "bench", **os.environ},
        stdout=subprocess.PIPE,
        text=True,
    )
    if found.returncode != 0:
        sys.exit("the set-up (tests/setup-env.sh) failed; see above")
    python = Path(found.stdout.strip()) / "bin" / "python"
    if Path(sys.prefix).resolve() != python.parent.parent.resolve():
        os.execv(str(python), [str(python), *sys.argv])


def load_of(record: dict[str, Any]) -> str:
    """The 1-minute load average before and after the run that measured a row (the machine is shared)."""
    return f"{record['load_before'][0]:.1f}->{record['load_after'][0]:.1f}"


def table(rows: list[tuple[str, ...]]) -> str:
    head = ("benchmark", "target", "measured", "result", "load")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in [head, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="CI size: small data, few trials")
    parser.add_argument("--only", help="comma-separated: " + ",".join(b.name for b in BENCHMARKS))
    parser.add_argument("--summary", type=Path, default=HERE / "results" / "summary.json")
    parser.add_argument("--no-setup", action="store_true", help="skip the virtualenv and database set-up")
    args = parser.parse_args()
    chosen = (
        [b for b in BENCHMARKS if b.name in args.only.split(",")]
        if args.only
        else [b for b in BENCHMARKS if b.by_default]
    )

    started = time.monotonic()
    if not args.no_setup:
        ensure_setup()
    tmp = Path(tempfile.mkdtemp(prefix="celery-orphans-bench-"))
    records: dict[str, dict[str, Any]] = {}
    by_name = {b.name: b for b in chosen}
    guests = [by_name[n] for n in ALONGSIDE_REFERENCE if n in by_name]
    if "sweep_scale" in by_name and guests:
        records.update(run_alongside(by_name["sweep_scale"], guests, args.quick, tmp))
    for bench in chosen:
        if bench.name not in records:
            records[bench.name] = run(bench, args.quick, tmp / f"{bench.name}.json")
    rows: list[tuple[str, ...]] = []
    for bench in chosen:
        record = records[bench.name]
        found = (
            bench.rows(record["results"])
            if "results" in record
            else [(bench.name, "runs", f"exit code {record['exit_code']}", "ERROR")]
        )
        rows += [(*row, load_of(record)) for row in found]
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    load = ", ".join(
        f"{name} {r['load_before'][0]:.2f}->{r['load_after'][0]:.2f}" for name, r in records.items()
    )
    print(f"\n{table(rows)}\n")
    print(
        f"{'quick' if args.quick else 'full'} run, {time.monotonic() - started:.0f} s; {os.cpu_count()} cores"
    )
    print(f"1-minute load before->after each benchmark: {load}")
    print(f"uptime: {uptime}")
    summary = {
        "quick": args.quick,
        "seconds": time.monotonic() - started,
        "cores": os.cpu_count(),
        "uptime": uptime,
        "table": [dict(zip(("benchmark", "target", "measured", "result", "load"), r)) for r in rows],
        "benchmarks": records,
    }
    args.summary.parent.mkdir(parents=True, exist_ok=True)
    args.summary.write_text(json.dumps(summary, indent=2, default=str))
    print(f"written: {args.summary.relative_to(ROOT) if args.summary.is_relative_to(ROOT) else args.summary}")
    sys.exit(1 if any(r[3] in {"FAIL", "ERROR"} for r in rows) else 0)


if __name__ == "__main__":
    main()
