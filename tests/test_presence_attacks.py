"""Presence attacked with real workers: its connection closed at Redis's end (an operator's CLIENT KILL, a
middlebox) while the worker's main process is stalled for less than its lease. Renewals 2 s apart and a
10 s lease, the defaults; the overlap checker judges what the task's executions did."""

from __future__ import annotations

import subprocess
import time
from typing import Any

import pytest

from celery_orphans.models import OrphanEvent
from celery_orphans.store import client
from celery_orphans.worker.presence import CLIENT_NAME
from tests.faults import effects, main_frozen, quiet, report, tick_beside_a_watcher

pytestmark = pytest.mark.worker


def presence_clients_of(pid: int) -> list[str]:
    """The ids Redis gives the presence connections that process ``pid`` holds."""
    ports = set()
    out = subprocess.run(["ss", "-tnpH"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        if f"pid={pid}," in line:
            ports.add(line.split()[3].rsplit(":", 1)[1])
    ids = []
    for entry in client().client_list():
        if entry.get("name") == CLIENT_NAME and entry["addr"].rsplit(":", 1)[1] in ports:
            ids.append(entry["id"])
    return ids


# Stalled longer than its wait (2.5 s) but less than its lease: before, 4.5 s gave a recovery 3.95 s into
# the stall while the stale execution acted 0.42 s more.
@pytest.mark.parametrize("pool", ["prefork", "threads"])
@pytest.mark.parametrize("stall", [4.5, 6.5])
def test_a_live_worker_stalled_less_than_its_lease_while_redis_drops_its_presence_runs_its_task_once(
    workers: Any, stall: float, pool: str
) -> None:
    live, result = tick_beside_a_watcher(workers, f"stalled-{pool}-{stall}", 20, pool=pool)
    held = presence_clients_of(live.pid)
    with main_frozen(live) as stopped:
        for client_id in held:
            client().client_kill_filter(_id=client_id)
        time.sleep(stall)
    found = quiet(result.id, seconds=3, timeout=60)
    first = found.executions[0]
    events = list(OrphanEvent.objects.filter(task_id=result.id).values_list("evidence", flat=True))
    report(
        "presence killed at Redis while the main process is stalled",
        pool=pool,
        stall=stall,
        presence_connections_killed=len(held),
        executions=len(found.executions),
        recovered_after=(found.started[found.executions[1]] - stopped) if len(found.executions) > 1 else -1.0,
        stale_effects=found.count,
        overlap_seconds=found.window,
        evidence=",".join(events) or "-",
        first_acted_until=max(e.at for e in effects(result.id) if e.execution == first) - stopped,
    )
    assert not found.stale, str(found)
