"""A message delivered before whose admission gets no answer in time is given back to the broker unrun.

A recovered copy (or a redelivery) may have an earlier delivery's entry in the ledger, which a sweep can
recover the task from; running it unprotected beside that would run it twice. So when its bounded admission
(``worker/admission_line.py``) times out, ``AdmittedRequest._orphans_hold`` hands it back to the broker
(``reject(requeue=True)``), warns once per task, and the broker delivers it again until the ledger answers;
each hand-back after the first waits a little longer, so that one that fails at once is not a tight loop.

The worker's ledger link goes through a proxy that blackholes the admission's own connection alone (it
names itself ``celery-orphans-admission``), made anew after each timeout, while the heartbeat's connection
keeps the lease renewed, so the worker never gives its boot up and never falls back to running the copy
without a lease.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from celery_orphans.models import OrphanEvent
from celery_orphans.worker.admission_line import ADMISSION_CLIENT_NAME
from tests.faults import report
from tests.helpers import finishes, ledger_env, started_on, starts, sweep_until, wait_for
from tests.services import TcpProxy

pytestmark = pytest.mark.worker

DARK_SECONDS = 6.0  # the link stays dark this long after the copy is sent: several hand-backs
HEARTBEAT = 0.5  # the suite's CELERY_ORPHANS_HEARTBEAT_SECONDS: the longest wait between hand-backs


@pytest.mark.parametrize("fault", ["blackhole", "cut"])
def test_a_recovered_copy_whose_admission_gets_no_answer_is_handed_back_unrun_then_runs_once(
    workers: Any, redis_client: Any, fault: str
) -> None:
    """``blackhole``: each admission waits out its bound. ``cut``: each fails at once, and the hand-backs
    after the first wait on the event loop, twice as long each time up to a heartbeat, instead of having
    the broker deliver the copy in a tight loop."""
    from celery import current_app
    from demoapp.tasks import summarize

    from celery_orphans.decision import Action

    port = int(redis_client.connection_pool.connection_kwargs["port"])
    proxy = TcpProxy(port, only=ADMISSION_CLIENT_NAME.encode())
    try:
        doomed = workers.start("doomed-hold@test", queues=("hold",))
        survivor = workers.start("survivor-hold@test", env=ledger_env(proxy), queues=("other",))
        result = summarize.apply_async(([2, 3],), {"seconds": 3}, queue="hold")
        started_on(result.id, "doomed-hold@test")
        doomed.kill()
        getattr(proxy, fault)()  # the admission's connection alone: the heartbeat's and the others go on
        current_app.control.add_consumer("hold", destination=["survivor-hold@test"], reply=True, timeout=5)
        sweep_until(result.id, Action.RECOVER)
        sent = time.monotonic()
        held = f"gave demoapp.summarize[{result.id}] back to the broker unrun"
        wait_for(lambda: held in survivor.log(), 20, "the recovered copy to be handed back", interval=0.1)
        first_hold = time.monotonic() - sent
        time.sleep(max(0.0, DARK_SECONDS - (time.monotonic() - sent)))

        log = survivor.log()
        assert starts(result.id) == 1, "the copy ran while its admission got no answer"
        deliveries = log.count(f"Task demoapp.summarize[{result.id}] received")
        assert deliveries >= 2, "handed back, and delivered again"
        assert deliveries <= 2 * DARK_SECONDS / HEARTBEAT + 8, "handed back in a tight loop"
        warned = [line for line in log.splitlines() if held in line and "WARNING" in line]
        assert len(warned) == 1, "warned once for the task, however often it is handed back"
        assert "gives up its boot" not in log
        proxy.restore()
        restored = time.monotonic()
        wait_for(lambda: starts(result.id) == 2, 20, "the recovered copy to run", interval=0.05)
        ran_after = time.monotonic() - restored

        assert result.get(timeout=30) == 5
    finally:
        proxy.close()
    assert starts(result.id) == 2 and finishes(result.id) == 1  # the lost run, and the recovered one once
    assert OrphanEvent.objects.filter(task_id=result.id).count() == 1
    report(
        f"recovered copy, admission connection {fault}",
        first_hold_seconds=first_hold,
        dark_seconds=DARK_SECONDS,
        started_after_restore_seconds=ran_after,
        deliveries_while_dark=deliveries,
        executions=2,
    )
