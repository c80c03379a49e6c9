"""A worker's own takeover of a task its main process holds (worker/takeover.py): decided by the pure
decision, carried out by the shared executor, as the worker. The paths that lead here with real workers
(a pool process killed, a message delivered again) are in test_pool_loss.py and test_redelivery.py."""

from __future__ import annotations

import functools
import uuid
from types import SimpleNamespace
from typing import Any

import pytest
from celery import current_app
from kombu.message import Message

from celery_orphans.decision import Action, Evidence, Reason
from celery_orphans.models import OrphanEvent
from celery_orphans.rules import after_pool_loss, after_redelivery
from celery_orphans.worker import takeover
from tests import factories
from tests.helpers import MakeHeartbeat, published_ids

pytestmark = pytest.mark.django_db(transaction=True)


def held_request(task_name: str = "demoapp.summarize") -> Any:
    """What a worker's main process holds for a delivery: its task, id and the message as delivered."""
    import demoapp.tasks  # noqa: F401  # registers the test project's tasks, as a worker's import does

    task_id = str(uuid.uuid4())
    made = factories.delivery(task_name, task_id, ([1, 2],))
    message = Message(
        body=made.raw_body(),
        content_type=made.content_type,
        content_encoding=made.content_encoding,
        headers=made.headers,
        properties=made.properties,
        delivery_info={"exchange": made.exchange, "routing_key": made.routing_key},
    )
    task = current_app.tasks[task_name]
    return SimpleNamespace(id=task_id, name=task_name, task=task, message=message, _orphans_token="tok-1")


@pytest.fixture
def admitted(redis_client, make_heartbeat: MakeHeartbeat) -> tuple[Any, Any]:
    """A request whose entry this worker boot wrote, as the Request hook does."""
    me = make_heartbeat("takeover@test")
    me.renew()
    request = held_request()
    takeover.boot_ledger(me).admit_delivery(takeover.entry_for(request, me, request._orphans_token))
    return request, me


def test_the_entry_of_a_held_request_names_this_boot_and_keeps_the_message(
    make_heartbeat: MakeHeartbeat, redis_client
):
    me = make_heartbeat("takeover@test")
    request = held_request()

    entry = takeover.entry_for(request, me, "tok-1")

    assert (entry.task_id, entry.task_name, entry.node, entry.boot, entry.token) == (
        request.id,
        "demoapp.summarize",
        "takeover@test",
        me.boot,
        "tok-1",
    )
    assert entry.delivery.raw_body() == request.message.body


def test_a_lost_pool_process_is_recovered_by_the_worker_and_audited_as_the_worker(admitted, redis_client):
    request, me = admitted

    outcome = takeover.take_over(request, me, 0, after_pool_loss)

    assert outcome.done
    assert (outcome.decision.action, outcome.decision.evidence, outcome.decision.attempt) == (
        Action.RECOVER,
        Evidence.POOL_CHILD_LOST,
        1,
    )
    assert published_ids(redis_client) == {request.id: 1}  # the exact message, sent again
    event = OrphanEvent.objects.get(task_id=request.id)
    assert (event.action, event.trigger, event.worker) == ("recovered", "worker", "takeover@test")


def test_a_redelivery_at_the_cap_is_marked_terminal_and_not_sent(admitted, redis_client):
    request, me = admitted
    at_cap = functools.partial(after_redelivery, limit_reached=True)

    outcome = takeover.take_over(request, me, 0, at_cap, lost_on="gone@test")

    assert outcome.done and outcome.worker == "gone@test"
    assert (outcome.decision.action, outcome.decision.reason) == (Action.MARK_TERMINAL, Reason.LIMIT_REACHED)
    assert published_ids(redis_client) == {}
    assert OrphanEvent.objects.get(task_id=request.id).action == "marked_terminal"


def test_a_takeover_of_a_task_that_moved_does_nothing(admitted, redis_client):
    request, me = admitted

    outcome = takeover.take_over(request, me, 5, after_pool_loss)  # the count moved on since

    assert not outcome.done and outcome.error is None
    assert published_ids(redis_client) == {}
    assert not OrphanEvent.objects.exists()
