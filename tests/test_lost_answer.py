"""A waiting admission whose write Redis applies while the boot's lease holds, but whose answer is lost.

A recovered copy's admission (``worker/admission_line.py``) waits for the admit script's verdict. Here its
connection to the ledger, already open, carries the worker's bytes to Redis and holds Redis's replies
(``one_way(UP)``, only on the admission's own connection, so the heartbeat goes on renewing the lease): the
script runs and writes the copy's entry, naming this worker's live boot, and the worker, with no answer in
time, gives the copy back to the broker unrun. Delivered again, to the same worker or to another, the copy
must not be taken for a duplicate of the live execution that entry names: none runs anywhere. A first
delivery that waits for its verdict (the outbox could not send its entry) is given back the same way.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import pytest

from celery_orphans.store import Keys
from celery_orphans.worker.admission_line import ADMISSION_CLIENT_NAME
from tests.faults import report
from tests.helpers import (
    finishes,
    ledger_env,
    outcome_of,
    started_on,
    starts,
    sweep_now,
    sweep_until,
    wait_for,
)
from tests.services import DOWN, UP, TcpProxy, purge

pytestmark = pytest.mark.worker

DARK_SECONDS = 4.0  # the replies are held this long after the copy is sent: it is given back meanwhile


def entry_names(redis_client: Any, task_id: str, node: str) -> bool:
    """Whether the task's ledger entry names ``node``, as its worker or by its lease."""
    entry = redis_client.hgetall(Keys.current().entry(task_id))
    return node.encode() in entry.get(b"entry", b"") + entry.get(b"lease", b"")


def second_run(task_id: str, since: float, what: str) -> tuple[float, str]:
    """Seconds from ``since`` until the task's second execution began (-1: not within 8 s) and, when it
    did not, what a sweep then decides (``none`` otherwise), its recovery given 5 s to run."""
    with contextlib.suppress(AssertionError):
        wait_for(lambda: starts(task_id) >= 2, 8, what, interval=0.05)
        return time.monotonic() - since, "none"
    # Dropped as a duplicate of the execution its entry names, which its live worker does not have: a
    # sweep that asks that worker could recover the task from the entry.
    found = outcome_of(sweep_now(), task_id).decision
    with contextlib.suppress(AssertionError):
        wait_for(lambda: starts(task_id) >= 2, 5, "a second recovery to run", interval=0.05)
    return -1.0, f"{found.action.value}:{found.reason.value}:{found.evidence.value}"


def final_state(result: Any) -> str:
    """The task's state once it ended (or 20 s passed), and a second more, in which a second run would
    have begun."""
    with contextlib.suppress(Exception):
        result.get(timeout=20)
    time.sleep(1)
    return str(result.state)


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"])
@pytest.mark.parametrize("redelivered_to", ["itself", "a peer"])
def test_a_recovered_copy_whose_written_entry_got_no_answer_runs_once_when_delivered_again(
    workers: Any, redis_client: Any, request: pytest.FixtureRequest, redelivered_to: str, broker: str
) -> None:
    """``itself``: the worker whose answer was lost gets the copy back. ``a peer``: another worker, whose
    own link is sound, is given it once the first gave it back. Before, either dropped it as a duplicate
    of the live execution the entry names, and the sweeps left the task to that worker (``boot_alive``)
    for as long as it lived: it never ran. On RabbitMQ, which puts the killed worker's message back at
    once, the copy is that message, redelivered once the killed boot's lease lapsed."""
    from celery import current_app
    from demoapp.tasks import summarize

    from celery_orphans.decision import Action

    on: dict[str, str] = {}
    if broker == "rabbitmq":
        on = {"CELERY_BROKER_URL": request.getfixturevalue("amqp_broker")}
        purge(on["CELERY_BROKER_URL"], "lost", "other", "peer")
    port = int(redis_client.connection_pool.connection_kwargs["port"])
    proxy = TcpProxy(port, only=ADMISSION_CLIENT_NAME.encode())
    try:
        doomed = workers.start("doomed-lost@test", env=on, queues=("lost",))
        survivor = workers.start("survivor-lost@test", env={**on, **ledger_env(proxy)}, queues=("other",))
        peer = (
            workers.start("peer-lost@test", env=on, queues=("peer",)) if redelivered_to == "a peer" else None
        )
        # A task with an ETA waits for its admission's verdict: it opens the admission's connection, on
        # which the copy's write then reaches Redis (a connection made while the replies are held never
        # gets past its handshake, and sends nothing).
        warm = summarize.apply_async(([1],), countdown=0.1, queue="other")
        assert warm.get(timeout=20) == 1
        result = summarize.apply_async(([2, 3],), {"seconds": 3}, queue="lost")
        started_on(result.id, "doomed-lost@test")
        doomed.kill()
        if on:
            # RabbitMQ puts the message back at once: delivered to the survivor once the killed boot's
            # lease lapsed, it is a redelivery of a lost execution, counted, whose write names the survivor.
            lease = Keys.current().lease("doomed-lost@test", "*")
            wait_for(lambda: not redis_client.keys(lease), 20, "the killed worker's lease to lapse")
            time.sleep(0.2)  # and its record's last renewal
        proxy.one_way(UP)  # the admission's writes reach Redis; its answers do not come back
        current_app.control.add_consumer("lost", destination=["survivor-lost@test"], reply=True, timeout=5)
        if not on:
            sweep_until(result.id, Action.RECOVER)
        sent = time.monotonic()
        held = f"gave demoapp.summarize[{result.id}] back to the broker unrun"
        wait_for(lambda: held in survivor.log(), 20, "the recovered copy to be handed back", interval=0.05)
        given_back_after = time.monotonic() - sent
        written = entry_names(redis_client, result.id, "survivor-lost@test")
        if peer is not None:
            current_app.control.cancel_consumer("lost", destination=["survivor-lost@test"], reply=True)
            current_app.control.add_consumer("lost", destination=["peer-lost@test"], reply=True, timeout=5)
        time.sleep(max(0.0, DARK_SECONDS - (time.monotonic() - sent)))
        ran_while_dark = starts(result.id) - 1
        proxy.restore()
        ran_after, swept = second_run(result.id, time.monotonic(), "the recovered copy to run")
        status = final_state(result)
    finally:
        proxy.close()
    logs = survivor.log() + (peer.log() if peer is not None else "")
    report(
        f"recovered copy written but unanswered, delivered again to {redelivered_to}, on {broker}",
        given_back_after_seconds=given_back_after,
        entry_written_by_the_unanswered_write=written,
        ran_while_dark=ran_while_dark,
        started_after_restore_seconds=ran_after,
        dropped_as_duplicate="dropped a duplicate" in logs,
        sweep=swept,
        status=status,
        executions=starts(result.id),
        finished=finishes(result.id),
    )
    assert written, "the unanswered write was not applied: this is not the case under test"
    assert ran_while_dark == 0
    # The entry is marked handed back before the copy goes back to the broker, once the answers come
    # again; delivered to the same worker, its write goes with the same token and writes over it.
    assert "dropped a duplicate" not in logs and swept == "none" and ran_after >= 0, swept
    assert starts(result.id) == 2 and finishes(result.id) == 1  # the lost run, and the recovered one once
    assert status == "SUCCESS" and result.get(timeout=1) == 5


def test_a_write_that_reaches_redis_after_its_message_was_given_back_writes_nothing(
    workers: Any, redis_client: Any
) -> None:
    """The recovered copy's write is held on its way to Redis (``one_way(DOWN)`` on the admission's
    connections). The worker, with no answer in time, closes that connection, marks the message handed
    back on a new one (which, once it passes, finds no entry) and gives the message back. The held write
    then reaches Redis, as TCP delivers what a closed socket had sent, before any other worker's admission
    of the copy. Before, it wrote an entry naming the live boot, unmarked: the peer the copy went to
    dropped it as a duplicate of that execution, and the sweeps left the task to the worker
    (``boot_alive``), which did not run it. The mark now makes the write's token void: it writes nothing,
    and the copy runs once on the peer."""
    from celery import current_app
    from demoapp.tasks import summarize

    from celery_orphans.decision import Action

    port = int(redis_client.connection_pool.connection_kwargs["port"])
    proxy = TcpProxy(port, only=ADMISSION_CLIENT_NAME.encode())
    control = current_app.control
    try:
        doomed = workers.start("doomed-late@test", queues=("late",))
        survivor = workers.start("survivor-late@test", env=ledger_env(proxy), queues=("other",))
        peer = workers.start("peer-late@test", queues=("peer",))
        warm = summarize.apply_async(([1],), countdown=0.1, queue="other")  # opens the admission's line
        assert warm.get(timeout=20) == 1
        result = summarize.apply_async(([2, 3],), {"seconds": 3}, queue="late")
        started_on(result.id, "doomed-late@test")
        doomed.kill()
        proxy.one_way(DOWN)  # what the admission sends on its connections is held on the way
        control.add_consumer("late", destination=["survivor-late@test"], reply=True, timeout=5)
        sweep_until(result.id, Action.RECOVER)
        received = f"demoapp.summarize[{result.id}] received"
        wait_for(lambda: received in survivor.log(), 20, "the survivor to receive the copy", interval=0.02)
        # Given back, the copy waits in the queue for the peer. Until then the mark, on a connection of
        # its own, is held too: the message stays with the survivor.
        control.cancel_consumer("late", destination=["survivor-late@test"], reply=True, timeout=5)
        proxy.spare_new()  # the connection the mark is tried on next passes
        held = f"gave demoapp.summarize[{result.id}] back to the broker unrun"
        wait_for(lambda: held in survivor.log(), 20, "the copy to be held", interval=0.05)
        time.sleep(2)  # the mark, tried again within a heartbeat, is answered, and the message goes back
        assert starts(result.id) == 1, "the copy ran while its write was held"
        proxy.restore()  # the held write reaches Redis
        time.sleep(0.5)
        written_late = entry_names(redis_client, result.id, "survivor-late@test")
        control.add_consumer("late", destination=["peer-late@test"], reply=True, timeout=5)
        ran_after, swept = second_run(result.id, time.monotonic(), "the copy to run on the peer")
        status = final_state(result)
    finally:
        proxy.close()
    report(
        "recovered copy's write held on its way, reaching Redis after the copy was given back",
        written_late=written_late,
        started_on_the_peer_after_seconds=ran_after,
        dropped_as_duplicate="dropped a duplicate" in peer.log(),
        sweep=swept,
        status=status,
        executions=starts(result.id),
        finished=finishes(result.id),
    )
    assert not written_late, "the held write, landing after the mark, wrote an entry naming the live boot"
    assert "dropped a duplicate" not in peer.log() and ran_after >= 0, swept
    assert f"{result.id}" in peer.log()
    assert starts(result.id) == 2 and finishes(result.id) == 1  # the lost run, and the recovered one once
    assert status == "SUCCESS" and result.get(timeout=1) == 5


def test_a_first_delivery_whose_waiting_admission_gets_no_answer_is_handed_back_then_runs_once(
    workers: Any, redis_client: Any
) -> None:
    """A first delivery waits for its admission's verdict when the outbox cannot send its entry (here its
    connection is closed as it is made). Its write reaches Redis and the answer is held: before, the
    task ran unprotected while its entry named the live boot; now it goes back to the broker unrun, its
    entry marked handed back once the answers come again, and it runs once."""
    from demoapp.tasks import summarize

    from celery_orphans.worker.line import OUTBOX_CLIENT_NAME

    port = int(redis_client.connection_pool.connection_kwargs["port"])
    admission = TcpProxy(port, only=ADMISSION_CLIENT_NAME.encode())
    outbox = TcpProxy(admission.port, only=OUTBOX_CLIENT_NAME.encode())  # in front of the other
    try:
        worker = workers.start("first-lost@test", env=ledger_env(outbox), queues=("first",))
        # A task with an ETA opens the admission's connection (see above); it makes no outbox connection.
        warm = summarize.apply_async(([1],), countdown=0.1, queue="first")
        assert warm.get(timeout=20) == 1
        outbox.cut()
        admission.one_way(UP)
        result = summarize.apply_async(([2, 3],), queue="first")
        sent = time.monotonic()
        held = f"gave demoapp.summarize[{result.id}] back to the broker unrun"
        with contextlib.suppress(AssertionError):
            wait_for(lambda: held in worker.log() or starts(result.id), 10, "the delivery to be held or run")
        decided_after = time.monotonic() - sent
        written = entry_names(redis_client, result.id, "first-lost@test")
        time.sleep(max(0.0, DARK_SECONDS - (time.monotonic() - sent)))
        ran_while_dark = starts(result.id)
        admission.restore()
        outbox.restore()
        restored = time.monotonic()
        ran_after = -1.0
        with contextlib.suppress(AssertionError):
            wait_for(lambda: starts(result.id) >= 1, 10, "the delivery to run", interval=0.05)
            ran_after = time.monotonic() - restored
        value = result.get(timeout=20)
        time.sleep(1)  # a second run would have begun by now
    finally:
        outbox.close()
        admission.close()
    report(
        "first delivery written but unanswered",
        decided_after_seconds=decided_after,
        entry_written_by_the_unanswered_write=written,
        ran_while_dark=ran_while_dark,
        started_after_restore_seconds=ran_after,
        executions=starts(result.id),
        finished=finishes(result.id),
    )
    assert written, "the unanswered write was not applied: this is not the case under test"
    assert ran_while_dark == 0, "the first delivery ran unprotected while its admission got no answer"
    assert held in worker.log() and "dropped a duplicate" not in worker.log()
    assert ran_after >= 0 and value == 5
    assert starts(result.id) == 1 and finishes(result.id) == 1
