"""Faults nobody had scripted, with real workers and the suite's 2 s lease: a worker cut off from its
ledger (blackholed, or one way) and a ledger write held by a dark link that lands once it heals.

A task run unprotected (fail open) on a live worker cut off from its ledger is asked about before it is
judged: its node answers through the broker that it runs the task, and the task is left to end as it
does. The same holds for a recovered copy taken by the worker whose ledger replies are held. A write held
up by the dark link lands after the boot it names was given up: it is refused, and the task runs once.
Each test reports what it measured.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from django_celery_results.models import TaskResult

from celery_orphans.models import OrphanEvent
from tests.faults import effects, overlap, quiet, report, seen_in_log
from tests.helpers import finishes, ledger_env, starts, sweep_now, task_on_a_doomed_worker, wait_for
from tests.services import DOWN, UP, TcpProxy

pytestmark = pytest.mark.worker


def tick_on(queue: str, seconds: float, every: float = 0.5) -> Any:
    from demoapp.tasks import tick

    return tick.apply_async((seconds,), {"every": every}, queue=queue)


def run_port(redis_client: Any) -> int:
    return int(redis_client.connection_pool.connection_kwargs["port"])


def status_of(task_id: str) -> str:
    row = TaskResult.objects.filter(task_id=task_id).first()
    return row.status if row else "PENDING"


def settle(result: Any, timeout: float = 90) -> None:
    """Sweep as Beat would until the task ends (SUCCESS or FAILURE)."""

    def ended() -> bool:
        sweep_now()
        return status_of(result.id) in ("SUCCESS", "FAILURE")

    wait_for(ended, timeout, f"{result.id} to end", interval=1)


class StatusHistory:
    """Every status the task's row passes through, polled every 0.05 s (with the row's worker)."""

    def __init__(self, task_id: str) -> None:
        self.task_id = task_id
        self.seen: list[tuple[float, str, str]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _poll(self) -> None:
        from django.db import connection

        try:
            while not self.stop.wait(0.05):
                rows = TaskResult.objects.filter(task_id=self.task_id).values_list("status", "worker")
                row = rows.first()
                now = (row[0], row[1] or "") if row else ("PENDING", "")
                if not self.seen or self.seen[-1][1:] != now:
                    self.seen.append((time.time(), *now))
        finally:
            connection.close()

    def close(self) -> str:
        self.stop.set()
        self.thread.join()
        t0 = self.seen[0][0] if self.seen else 0.0
        return " > ".join(f"{s}@{w.split('@')[0]}+{t - t0:.1f}" for t, s, w in self.seen)


def outcome(fault: str, result: Any, **extra: Any) -> dict[str, Any]:
    found = quiet(result.id, seconds=2.0, timeout=90)
    audit = [
        f"{a}:{r}:{e}:{w.split('@')[0]}"
        for a, r, e, w in OrphanEvent.objects.filter(task_id=result.id)
        .order_by("created_at")
        .values_list("action", "reason", "evidence", "worker")
    ]
    measured = {
        "executions": len(found.executions),
        "stale_effects": found.count,
        "overlap_seconds": found.window,
        "status": status_of(result.id),
        "finishes": finishes(result.id),
        "starts": starts(result.id),
        "audit": ",".join(audit),
        **extra,
    }
    report(fault, **measured)
    return measured


def assert_never_twice(m: dict[str, Any]) -> None:
    assert "marked_terminal" not in m["audit"], m
    assert m["stale_effects"] == 0, m
    assert m["status"] == "SUCCESS", m
    assert m["finishes"] == 1, m


@pytest.mark.parametrize("where", ["anywhere", "doomed"])
@pytest.mark.parametrize("direction", [UP, DOWN])
def test_one_way_cut_of_the_ledger_connection(
    workers: Any, redis_client: Any, direction: str, where: str
) -> None:
    from celery import current_app

    proxy = TcpProxy(run_port(redis_client))
    try:
        doomed, result = task_on_a_doomed_worker(
            workers, "oneway", lambda q: tick_on(q, 10), doomed_env=ledger_env(proxy)
        )
        if where == "doomed":  # the recovered copy can only go to the cut-off worker
            current_app.control.cancel_consumer(
                "oneway", destination=["watcher-oneway@test"], reply=True, timeout=5
            )
        history = StatusHistory(result.id)
        proxy.one_way(direction)
        cut = time.time()
        wait_for(
            lambda: len(overlap(result.id).executions) >= 2 or status_of(result.id) != "STARTED",
            40,
            "the task to run again",
        )
        recovered_at = time.time()
        time.sleep(4)
        proxy.restore()
        settle(result)
        m = outcome(
            f"one-way {direction} ledger, recovery taken {where}",
            result,
            recovered_after=recovered_at - cut,
            ran_on=",".join(sorted({str(e.pid) for e in effects(result.id)})),
            history=history.close(),
        )
        print("\n".join(line for line in doomed.log().splitlines() if "celery-orphans" in line)[-8000:])
    finally:
        proxy.close()
    assert_never_twice(m)


@pytest.mark.parametrize("fault", ["blackhole", "one_way_up"])
def test_a_task_run_unprotected_on_a_live_worker_cut_off_from_its_ledger_is_not_marked_failure(
    workers: Any, redis_client: Any, fault: str
) -> None:
    """Fail open runs a task unprotected on a worker that holds no lease; a sweep meanwhile must not mark
    that live task FAILURE (and revoke it) because its node has no live boot to ask. A worker fails open
    once its trouble has lasted ``LEDGER_HOLD_SECONDS`` (it gives the delivery back to the broker until
    then); 0 here, so it does at once."""
    proxy = TcpProxy(run_port(redis_client))
    try:
        env = {**ledger_env(proxy), "CELERY_ORPHANS_LEDGER_HOLD_SECONDS": "0"}
        worker = workers.start("cutoff@test", env=env, queues=("cutoff",))
        if fault == "blackhole":
            proxy.blackhole()
        else:
            proxy.one_way(UP)
        seen_in_log(worker, "gives up its boot", 30)
        result = tick_on("cutoff", 12)
        wait_for(lambda: status_of(result.id) == "STARTED", 30, "the task to start")
        history = StatusHistory(result.id)
        # Past the last renewal's lease, as any sweep that comes a few seconds later is.
        time.sleep(3)
        sweeps = [sweep_now() for _ in range(2)]
        marked = [o for s in sweeps for o in s.outcomes if o.done]
        decided = [(o.decision.action.value, o.decision.reason.value) for s in sweeps for o in s.outcomes]
        print("sweep decisions:", decided)
        state_after_sweep = status_of(result.id)
        still_running = time.time() - max(e.at for e in effects(result.id)) < 1
        proxy.restore()
        assert result.get(timeout=60, propagate=False) is not None
        m = outcome(
            f"live worker cut off from its ledger ({fault}), task run unprotected, swept",
            result,
            sweep_actions=",".join(f"{o.decision.action.value}:{o.decision.evidence}" for o in marked),
            history=history.close(),
            state_after_sweep=state_after_sweep,
            body_still_acting_then=still_running,
        )
    finally:
        proxy.close()
    assert_never_twice(m)


def test_an_admission_held_by_a_dark_link_that_lands_later_does_not_run_the_task_twice(
    workers: Any, redis_client: Any
) -> None:
    """A delivery arrives as the ledger link goes dark: its admission write is held (not lost), the worker
    gives up waiting; when the link heals the write lands, naming a boot that has since been given up."""
    proxy = TcpProxy(run_port(redis_client))
    try:
        worker = workers.start("held@test", env=ledger_env(proxy), queues=("held",))
        workers.start("helper@test", queues=("other",))
        time.sleep(1.5)
        proxy.blackhole()
        result = tick_on("held", 6)
        time.sleep(4.5)
        proxy.restore()
        history = StatusHistory(result.id)
        settle(result)
        time.sleep(3)
        for _ in range(3):
            sweep_now()
            time.sleep(1)
        m = outcome("admission held in a dark link, landing later", result, history=history.close())
        print("\n".join(line for line in worker.log().splitlines() if "celery-orphans" in line)[-6000:])
    finally:
        proxy.close()
    assert_never_twice(m)
    assert m["starts"] == 1, m
