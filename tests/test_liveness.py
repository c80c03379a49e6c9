"""The one broadcast a sweep sends: every named node has the timeout, counted from the sending, to answer."""

from __future__ import annotations

import time

import pytest
import redis
from django_celery_results.models import TaskResult
from kombu.pidbox import Mailbox

from celery_orphans.models import OrphanEvent
from celery_orphans.sweep import liveness
from tests.helpers import started_on, starts, summarize_on_a_doomed_worker, wait_for

pytestmark = pytest.mark.worker

DEAD = "never-started@test"


def test_a_late_reply_does_not_restart_the_wait_for_a_silent_node(workers, celery_app):
    """A solo worker answers only once its task ends: Celery's inspect would then wait the whole
    timeout again for the silent node; the question ends the timeout after it was sent."""
    from demoapp.tasks import summarize

    workers.start("late@test", pool="solo")
    result = summarize.delay([1], seconds=4.5)
    started_on(result.id, "late@test")
    time.sleep(1.5)  # the task ends about 3 s after the question goes out

    asked = time.monotonic()
    held = liveness.ask_workers(celery_app, ["late@test", DEAD], [result.id], timeout=4.0)
    waited = time.monotonic() - asked

    assert held == {"late@test": frozenset()}  # it answered, after its task ended
    # Celery's own wait would be about 3 + 4 s; a slow machine lengthens ours far less than that.
    assert 4.0 <= waited < 6.0


def test_the_wait_ends_as_soon_as_every_node_answered(workers, celery_app):
    from demoapp.tasks import summarize

    workers.start("busy@test")
    workers.start("idle@test", queues=("nothing-is-sent-here",))
    result = summarize.delay([1], seconds=20)
    started_on(result.id, "busy@test")

    asked = time.monotonic()
    held = liveness.ask_workers(celery_app, ["busy@test", "idle@test"], [result.id], timeout=30.0)

    assert held == {"busy@test": frozenset({result.id}), "idle@test": frozenset()}
    assert time.monotonic() - asked < 15.0
    wait_for(result.ready, 30, "the task to end")


def test_a_question_whose_replies_were_cut_off_leaves_no_binding_that_hides_the_next_ones_replies(
    workers, redis_client, celery_app, monkeypatch
):
    """A broken wait must not leave the reply queue's binding recorded on the pooled connection: a later
    question with a reply queue of the same name would skip binding it, and its replies would be lost."""
    workers.start("rebind@test")
    # The reply queue is named by process, thread and a short-lived object's address, which CPython reuses.
    monkeypatch.setattr(Mailbox, "oid", property(lambda self: "5ca1ab1e-0000-3000-8000-000000000000"))
    gather = liveness._Question._gather

    def broken_once(self, connection, mailbox, ticket, deadline):
        monkeypatch.setattr(liveness._Question, "_gather", gather)
        connection.drain_events = cut
        try:
            gather(self, connection, mailbox, ticket, deadline)
        finally:
            del connection.drain_events

    def cut(*args, **kwargs):
        raise redis.ConnectionError("Connection closed by server.")

    monkeypatch.setattr(liveness._Question, "_gather", broken_once)
    assert liveness.ask_workers(celery_app, ["rebind@test"], [], timeout=2.0) == {"rebind@test": frozenset()}
    redis_client.flushdb()  # the broker loses its bindings (a restart, a failover)

    assert liveness.ask_workers(celery_app, ["rebind@test"], [], timeout=2.0) == {"rebind@test": frozenset()}


@pytest.mark.worker
def test_a_leftover_row_of_a_task_no_longer_registered_does_not_hold_up_a_dead_worker_s_recovery(
    workers,
):
    """A STARTED row of a task renamed away by a deploy, on a node long gone (no boot of it on record), is
    reported, never judged: its node's answer decides nothing, so it is not asked. Since nodes without a
    live boot are asked (a worker cut off from its ledger holds none), every sweep asked it, and waited out
    its silence before deciding anything: with an 8 s inspect timeout, the watch's sweep after a SIGKILL
    sent the dead worker's task again 8.6 s after the kill instead of 0.8 to 0.9 s (load 9 on 2 cores),
    and every later sweep waited as long."""
    from tests.factories import orphan

    leftover = orphan("demoapp.renamed_away", started_ago=600, entry=False, worker="retired@test")
    env = {"CELERY_ORPHANS_INSPECT_TIMEOUT_SECONDS": "8"}
    doomed, result = summarize_on_a_doomed_worker(workers, "leftover", seconds=30, env=env)

    killed = time.monotonic()
    doomed.kill()
    wait_for(lambda: starts(result.id) == 2, 30, "the dead worker's task to run again")
    after = time.monotonic() - killed

    [event] = OrphanEvent.objects.filter(task_id=result.id)
    assert (event.action, event.evidence) == ("recovered", "process_exited")
    assert after < 8, f"the sweep waited out the silence of a node it had no need to ask ({after:.2f} s)"
    assert TaskResult.objects.get(task_id=leftover).status == "STARTED"  # reported, untouched
