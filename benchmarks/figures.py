"""Reading the benchmarks' figures: what Redis's own accounts say a task cost, and when a worker was ready.

Pure functions, kept apart from the benchmarks' servers and workers so they can be tested alone.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Mapping
from datetime import datetime
from typing import Any

# The commands a benchmark itself sends to read the counters or set up a connection: not the workload's.
OWN = frozenset({"info", "config|resetstat", "client|setname", "hello", "ping", "script|load"})
SCRIPT_CALLS = frozenset({"evalsha", "eval", "fcall"})


def counters(
    commandstats: Mapping[str, Mapping[str, Any]], cpu: Mapping[str, Any], stats: Mapping[str, Any]
) -> dict[str, float]:
    """Redis's counters from ``INFO commandstats``, ``INFO cpu`` and ``INFO stats`` as redis-py parses
    them: calls and microseconds per command (``cmd:<name>``, ``usec:<name>``), CPU seconds (``cpu``:
    ``used_cpu_sys`` + ``used_cpu_user``), network bytes (``in``, ``out``)."""
    found: dict[str, float] = {}
    for name, v in commandstats.items():
        command = name.removeprefix("cmdstat_")
        found[f"cmd:{command}"] = float(v["calls"])
        found[f"usec:{command}"] = float(v["usec"])
    found["cpu"] = float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"])
    found["in"] = float(stats["total_net_input_bytes"])
    found["out"] = float(stats["total_net_output_bytes"])
    return found


def per_task(before: Mapping[str, float], after: Mapping[str, float], tasks: int) -> dict[str, Any]:
    """What each of ``tasks`` cost Redis between two ``counters``: CPU, calls, commands and bytes.

    A call is what a client sent: a script call, or a command on its own when no script was called. The
    commands are every command Redis ran, those inside the scripts included (Redis counts both).
    """
    if tasks <= 0:
        raise ValueError(f"no task was carried ({tasks})")
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    workload = {
        k.removeprefix("cmd:"): v
        for k, v in delta.items()
        if k.startswith("cmd:") and v > 0 and k.removeprefix("cmd:") not in OWN
    }
    scripted = sum(v for k, v in workload.items() if k in SCRIPT_CALLS)
    calls = scripted if scripted else sum(workload.values())
    # Redis's own clock of executing the calls; a script's time holds what runs inside it.
    executing = sum(delta.get(f"usec:{k}", 0.0) for k in workload if k in SCRIPT_CALLS or not scripted)
    cpu = delta["cpu"]
    return {
        "tasks": tasks,
        "redis_cpu_seconds": cpu,
        "tasks_per_core_second": tasks / cpu if cpu > 0 else float("inf"),
        "redis_cpu_us_per_task": cpu / tasks * 1e6,
        "executing_us_per_task": executing / tasks,
        "calls_per_task": calls / tasks,
        "commands_per_task": sum(workload.values()) / tasks,
        "by_command": {k: round(v / tasks, 3) for k, v in sorted(workload.items())},
        "bytes_in_per_task": delta["in"] / tasks,
        "bytes_out_per_task": delta["out"] / tasks,
    }


def spread(values: list[float]) -> dict[str, float]:
    """The minimum, median and maximum of ``values``."""
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


# Celery's log line: "[2026-11-26 03:57:01,841: INFO/MainProcess] p1@bench ready."
READY_LINE = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}): INFO/MainProcess\] \S+ ready\.$", re.M)


def ready_at(log: str) -> float:
    """When a worker said it was ready, as seconds since the epoch, from the first "ready." line of its
    log (Celery writes it in local time, to the millisecond)."""
    found = READY_LINE.search(log)
    if found is None:
        raise ValueError("no ready line in the worker's log")
    return datetime.strptime(found.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
