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
from django_celery_results.models import TaskResult

from celery_orphans.models import OrphanEvent
from celery_orphans.worker.admission_line import ADMISSION_CLIENT_NAME
from tests.faults import report
from tests.helpers import finishes, ledger_env, started_on, starts, sweep_now, sweep_until, wait_for
from tests.services import TcpProxy

pytestmark = pytest.mark.worker

DARK_SECONDS = 6.0  # the link stays dark this long after the copy is sent: several hand-backs
HEARTBEAT = 0.5  # the suite's CELERY_ORPHANS_HEARTBEAT_SECONDS: the longest wait between hand-backs
SHORT_VISIBILITY = {"TESTPROJECT_VISIBILITY_TIMEOUT": "2"}


@pytest.mark.parametrize(
    ("fault", "pool"), [("blackhole", "prefork"), ("cut", "prefork"), ("cut", "gevent"), ("cut", "eventlet")]
)
def test_a_recovered_copy_whose_admission_gets_no_answer_is_handed_back_unrun_then_runs_once(
    workers: Any, redis_client: Any, fault: str, pool: str
) -> None:
    """``blackhole``: each admission waits out its bound. ``cut``: each fails at once, and the hand-backs
    after the first wait on the event loop (in a greenlet on gevent and eventlet, which have none), twice
    as long each time up to a heartbeat, instead of having the broker deliver the copy in a tight loop."""
    from celery import current_app
    from demoapp.tasks import summarize

    from celery_orphans.decision import Action

    port = int(redis_client.connection_pool.connection_kwargs["port"])
    proxy = TcpProxy(port, only=ADMISSION_CLIENT_NAME.encode())
    try:
        doomed = workers.start("doomed-hold@test", queues=("hold",))
        survivor = workers.start("survivor-hold@test", pool=pool, env=ledger_env(proxy), queues=("other",))
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
        f"recovered copy, admission connection {fault}, {pool} pool",
        first_hold_seconds=first_hold,
        dark_seconds=DARK_SECONDS,
        started_after_restore_seconds=ran_after,
        deliveries_while_dark=deliveries,
        executions=2,
    )


# --- a ledger that refuses writes: a bounded hold, then fail open ----------------------------------------


def _refusing(
    workers: Any, ledger_redis: Any, name: str, env: dict[str, str] | None = None, how: str = "oom"
) -> Any:
    """A worker whose ledger refuses writes, once it has given its boot up for it: it holds no lease, and
    cannot take the next while the refusal lasts."""
    worker = workers.start(name, env={**ledger_env(ledger_redis), **(env or {})}, queues=("refused",))
    ledger_redis.refuse_writes(how)
    wait_for(lambda: "gives up its boot" in worker.log(), 15, "the boot to be given up", interval=0.05)
    return worker


@pytest.mark.usefixtures("redis_client")
@pytest.mark.parametrize("how", ["oom", "readonly"])
def test_a_task_delivered_while_the_ledger_refuses_writes_is_held_and_survives_its_worker_dying(
    workers: Any, ledger_redis: Any, how: str
) -> None:
    """Before, the delivery ran unprotected (fail open), and the worker killed under it left a ``STARTED``
    row with no entry, which the sweep marked ``FAILURE`` once the ledger took writes again. Now it goes
    back to the broker unrun while the refusal lasts; once its worker is gone, the next one runs it once."""
    from demoapp.tasks import summarize

    refused = _refusing(workers, ledger_redis, "refused-hold@test", how=how)
    result = summarize.apply_async(([2, 3],), {"seconds": 5}, queue="refused")
    # Said once for the worker, not once per task: each task's hand-back is a DEBUG line.
    held = "cannot record deliveries in the ledger (its worker holds no lease): they go back to the broker"
    wait_for(lambda: held in refused.log() or starts(result.id), 15, "the delivery to be held or run")
    time.sleep(2)  # a run would be under way
    ran_while_refused = starts(result.id)
    refused.kill()
    ledger_redis.accept_writes()
    time.sleep(1)
    swept = [sweep_now() for _ in range(2)]
    marked = [
        f"{o.decision.action.value}:{o.decision.evidence}"
        for s in swept
        for o in s.outcomes
        if o.decision.task_id == result.id
    ]
    # The Redis transport keeps what a killed worker held until its visibility timeout: a short one here,
    # restored as the next worker starts.
    time.sleep(2.5)
    workers.start(
        "after-hold@test", env={**ledger_env(ledger_redis), **SHORT_VISIBILITY}, queues=("refused",)
    )
    assert result.get(timeout=30) == 5
    report(
        f"task delivered while the ledger refuses writes ({how}), its worker killed",
        ran_while_refused=ran_while_refused,
        sweep_decisions=",".join(marked) or "none",
        starts=starts(result.id),
        finishes=finishes(result.id),
    )

    assert ran_while_refused == 0, "the delivery ran unrecorded while the ledger refused writes"
    assert held in refused.log() and f"cannot record demoapp.summarize[{result.id}]" not in refused.log()
    assert marked == [], marked
    assert starts(result.id) == 1 and finishes(result.id) == 1
    assert not OrphanEvent.objects.filter(task_id=result.id).exists()


@pytest.mark.usefixtures("redis_client")
def test_with_no_hold_a_task_delivered_while_the_ledger_refuses_writes_runs_unprotected_at_once(
    workers: Any, ledger_redis: Any
) -> None:
    """``LEDGER_HOLD_SECONDS=0``: the old rule, fail open at once; the task runs unrecorded and ends."""
    from demoapp.tasks import summarize

    refused = _refusing(workers, ledger_redis, "open@test", {"CELERY_ORPHANS_LEDGER_HOLD_SECONDS": "0"})
    result = summarize.apply_async(([2, 3],), {"seconds": 0.5}, queue="refused")
    assert result.get(timeout=20) == 5
    log = refused.log()
    assert "run unprotected until its ledger records them again" in log
    assert "back to the broker unrun" not in log
    assert starts(result.id) == 1


@pytest.mark.usefixtures("redis_client")
def test_a_task_delivered_while_the_ledger_refuses_writes_runs_unprotected_once_the_hold_ran_out(
    workers: Any, ledger_redis: Any
) -> None:
    """The hold is bounded from the worker's side: its trouble began at the first refused renewal, and a
    delivery held past ``LEDGER_HOLD_SECONDS`` of it runs, unrecorded, with one warning for the worker."""
    from demoapp.tasks import summarize

    hold = 3.0
    refused = _refusing(
        workers, ledger_redis, "bounded@test", {"CELERY_ORPHANS_LEDGER_HOLD_SECONDS": str(hold)}
    )
    met = time.monotonic()
    result = summarize.apply_async(([2, 3],), {"seconds": 0.5}, queue="refused")
    assert result.get(timeout=30) == 5
    ran_after = time.monotonic() - met
    log = refused.log()
    assert "cannot record deliveries in the ledger (its worker holds no lease)" in log
    said = "WARNING/MainProcess] celery-orphans: worker bounded@test cannot record its deliveries"
    assert log.count(said) == 1, "said once for the worker, not per message"
    assert starts(result.id) == 1
    assert ran_after >= hold - 1, ran_after  # the renewal met the refusal at most a heartbeat before
    report("refused writes, hold of 3 s", ran_after_seconds=ran_after)


@pytest.mark.usefixtures("redis_client")
def test_an_execution_given_up_before_its_refused_entry_was_answered_goes_back_with_its_row_out_of_started(
    workers: Any, ledger_redis: Any
) -> None:
    """A first delivery received as the ledger turns read-only is sent to the pool before Redis refuses
    its entry; the boot is given up, the execution stopped, and the message goes back to the broker. Its
    row said ``STARTED`` meanwhile, with no entry: once writes came back, a sweep marked it ``FAILURE``
    (the worker answered without the task) and the copy the broker delivered next was dropped. Now the row
    says ``RETRY`` until that copy runs."""
    from demoapp.tasks import summarize

    worker = workers.start("refused-row@test", env=ledger_env(ledger_redis), queues=("refused",))
    ledger_redis.refuse_writes("readonly")  # OOM would let the admission's write through (it deletes first)
    result = summarize.apply_async(([2, 3],), {"seconds": 4}, queue="refused")
    wait_for(lambda: "gives up its boot" in worker.log(), 15, "the boot to be given up", interval=0.05)
    time.sleep(1)  # the forfeit's hand-back has happened by now
    ran = starts(result.id)
    row = TaskResult.objects.filter(task_id=result.id).first()
    status_while_refused = row.status if row is not None else "none"
    ledger_redis.accept_writes()
    swept = [sweep_now() for _ in range(2)]
    marked = [o.decision.action.value for s in swept for o in s.outcomes if o.decision.task_id == result.id]
    assert result.get(timeout=30) == 5
    report(
        "execution given up before its refused entry was answered",
        started_before_the_give_up=ran,
        row_while_refused=status_while_refused,
        sweep_decisions=",".join(marked) or "none",
        finishes=finishes(result.id),
    )
    if ran:  # the usual case: it reached the pool before the renewal met the refusal
        assert status_while_refused == "RETRY", status_while_refused
    assert marked == [], marked
    assert finishes(result.id) == 1
    assert not OrphanEvent.objects.filter(task_id=result.id, action="marked_terminal").exists()
