"""A ledger gone dark (packets dropped, nothing closed) holds a worker's main loop no longer than its
heartbeat's own calls may take: what is left of the boot's validity, or a heartbeat while no lease holds.

Before, the outbox's ``take`` and ``release(now=True)`` and the fence read of a delivery that is not
first-hand went through the ledger's client, which waits its 5 s socket timeout and tries again; the main
loop fetched, acknowledged and answered nothing meanwhile.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.faults import report
from tests.helpers import ledger_env, starts, wait_for
from tests.services import TcpProxy

pytestmark = pytest.mark.worker

HEARTBEAT = 0.5  # the suite's CELERY_ORPHANS_HEARTBEAT_SECONDS: a call's bound while no lease holds
# The calls measured here are those of a worker that runs its deliveries over a dark ledger, unrecorded:
# it fails open once its trouble has lasted LEDGER_HOLD_SECONDS (it gives them back to the broker until
# then), here at once.
FAIL_OPEN = {"CELERY_ORPHANS_LEDGER_HOLD_SECONDS": "0"}


def first_start(task_id: str) -> float:
    """When the body of ``task_id`` began (its worker's clock, which is this machine's)."""
    from demoapp.tasks import runs

    return float(next(e for e in runs(task_id) if e.startswith("start")).split(":")[-1])


def test_a_fence_read_over_a_dark_ledger_holds_the_main_loop_no_longer_than_a_heartbeat(
    workers: Any, redis_client: Any
) -> None:
    from demoapp.tasks import summarize

    proxy = TcpProxy(int(redis_client.connection_pool.connection_kwargs["port"]))
    try:
        worker = workers.start("dark-loop@test", env={**ledger_env(proxy), **FAIL_OPEN})
        proxy.blackhole()
        wait_for(lambda: "gives up its boot" in worker.log(), 10, "the boot to be given up", interval=0.1)
        # A message with an ETA is never first-hand: without a lease it runs once its fence is read.
        eta = time.time() + 1.0
        result = summarize.apply_async(([2, 3],), {"seconds": 0.1}, countdown=1.0)
        wait_for(lambda: starts(result.id) == 1, 40, "the task to run", interval=0.05)
        held = first_start(result.id) - eta
        assert result.get(timeout=10) == 5
    finally:
        proxy.close()
    report("fence read over a dark ledger", main_loop_held_seconds=held, bound_seconds=HEARTBEAT)
    assert held < HEARTBEAT + 1.0, f"the main loop was held {held:.2f} s by the fence read"


def test_a_release_over_a_dark_ledger_holds_the_main_loop_no_longer_than_the_validity(
    workers: Any, redis_client: Any
) -> None:
    """A task without a result row has its entry removed at its acknowledgement, before the next task
    (``outbox.release(now=True)``); its ledger gone dark just before it ends, the next task waits only for
    what is left of the validity, then for its own bounded admission."""
    from demoapp.noharm import no_result
    from demoapp.noharm import runs as ended
    from demoapp.tasks import summarize

    proxy = TcpProxy(int(redis_client.connection_pool.connection_kwargs["port"]))
    try:
        worker = workers.start(
            "dark-release@test", env={**ledger_env(proxy), **FAIL_OPEN}, include=("demoapp.noharm",)
        )
        first = no_result.delay(1.0)
        wait_for(lambda: f"[{first.id}] received" in worker.log(), 20, "the first task", interval=0.02)
        time.sleep(0.7)
        proxy.blackhole()  # 0.3 s before the body ends; the boot holds 0.8 s at least
        second = summarize.delay([2, 3])
        wait_for(lambda: starts(second.id) == 1, 120, "the next task to run", interval=0.05)
        held = first_start(second.id) - ended(first.id)[0]["ended"]
    finally:
        proxy.close()
    report("release over a dark ledger", next_task_held_seconds=held, bound_seconds=1.3 + 2.0)
    assert held < 1.3 + 2.0 + 1.0, f"the next task waited {held:.2f} s behind the release"


def test_a_hand_back_over_a_dark_ledger_holds_the_main_loop_no_longer_than_the_validity(
    workers: Any, redis_client: Any
) -> None:
    """A task that gives its message back (``Reject(requeue=True)``) has its entry marked handed back
    first; its ledger gone dark just before, the message goes back after what is left of the validity, and
    runs again once its own bounded admissions have given up (the boot given up meanwhile)."""
    from demoapp.tasks import requeue_once, runs

    proxy = TcpProxy(int(redis_client.connection_pool.connection_kwargs["port"]))
    try:
        workers.start("dark-hand-back@test", env={**ledger_env(proxy), **FAIL_OPEN})
        result = requeue_once.delay(1.0)
        wait_for(lambda: starts(result.id) == 1, 20, "the first run", interval=0.02)
        time.sleep(0.7)
        proxy.blackhole()  # 0.3 s before the body gives its message back; the boot holds 0.8 s at least
        wait_for(lambda: starts(result.id) == 2, 120, "the task to run again", interval=0.05)
        first, again = (float(e.split(":")[-1]) for e in runs(result.id) if e.startswith("start"))
        held = again - (first + 1.0)
    finally:
        proxy.close()
    report("hand-back over a dark ledger", run_again_after_seconds=held, bound_seconds=1.3 + 2.0 + HEARTBEAT)
    assert held < 1.3 + 2.0 + HEARTBEAT + 1.5, f"the task ran again {held:.2f} s after its hand-back"
