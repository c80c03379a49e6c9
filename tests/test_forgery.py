"""Forged ledger entries, written by someone who can write to the ledger's Redis and nothing else.

The ledger lives in a Redis of its own here (``ledger_redis``), apart from the broker, on both brokers:
with RabbitMQ, or a ledger Redis of its own, write access to the ledger must not become a way into the
broker. Each forgery below is an entry of a ``@recoverable`` task whose message would run something else
(a callback, a chain link or an errback naming a task that is not recoverable), go somewhere else (a
queue of the writer's choosing) or talk to the workers (a ``shutdown`` broadcast on ``celery.pidbox``).
None is sent; each is reported and audited.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import pytest
from celery import current_app
from kombu import Connection, Queue

from celery_orphans.decision import Action, Reason
from celery_orphans.entry import FORGED, Delivery
from celery_orphans.models import AuditAction, OrphanEvent
from celery_orphans.recovery import broker
from celery_orphans.store import Keys, client
from tests import factories
from tests.helpers import ledger_env, outcome_of, sweep_now, wait_for

BROKERS = ["redis", "rabbitmq"]
FORGED_QUEUE = "forged-queue"


@pytest.fixture(params=BROKERS)
def broker_url(request: pytest.FixtureRequest, ledger_redis: Any, redis_client: Any) -> str:
    """The broker of the test (the run's own Redis, or its RabbitMQ vhost); the ledger is apart."""
    if request.param == "rabbitmq":
        url: str = request.getfixturevalue("amqp_broker")
        _declare(url, FORGED_QUEUE)
        return url
    return str(current_app.conf.broker_url)


def _declare(url: str, name: str) -> None:
    with Connection(url) as conn:
        queue = Queue(name, routing_key=name, channel=conn.default_channel)
        queue.declare()
        queue.purge()


def waiting(url: str, queue: str) -> list[tuple[dict[str, Any], Any]]:
    """The headers and decoded body of every message waiting in ``queue``, left there."""
    found = []
    with Connection(url) as conn:
        simple = conn.SimpleQueue(queue, no_ack=False)
        while True:
            try:
                message = simple.get(block=True, timeout=0.2)
            except simple.Empty:
                break
            found.append((dict(message.headers), message.decode()))
        simple.close()
    return found


def forge(delivery: Delivery) -> str:
    """Write an entry into the ledger as a worker would, without the signing key: its JSON, no tag."""
    task_id = str(delivery.headers["id"])
    entry = factories.ledger_entry(delivery, recorded_at=time.time() - 60)
    keys, conn = Keys.current(), client()
    conn.hset(
        keys.entry(task_id),
        mapping={"token": entry.token, "entry": entry.to_json(), "copy": "0:0", "lease": ""},
    )
    conn.zadd(keys.inflight, {task_id: entry.recorded_at})
    return task_id


def _scan(task_id: str) -> dict[str, Any]:
    return dict(current_app.signature("demoapp.scan", args=("the forger's target",)).set(task_id=task_id))


def _summarize(task_id: str, args: tuple[Any, ...], **options: Any) -> Delivery:
    message = current_app.amqp.as_task_v2(task_id, "demoapp.summarize", args, {}, **options)
    body = json.dumps(message.body)
    return Delivery(
        body=body,
        body_encoding="utf-8",
        content_type="application/json",
        content_encoding="utf-8",
        headers=dict(message.headers),
        properties={"correlation_id": task_id, "priority": 0, "delivery_mode": 2},
        exchange="",
        routing_key="celery",
        delivery_tag=None,
    )


def forged_callback(task_id: str, scan_id: str) -> Delivery:
    return _summarize(task_id, ([1, 2],), callbacks=[_scan(scan_id)])


def forged_chain(task_id: str, scan_id: str) -> Delivery:
    return _summarize(task_id, ([1, 2],), chain=[_scan(scan_id)])


def forged_errback(task_id: str, scan_id: str) -> Delivery:
    # sum() of text fails: the errback runs.
    return _summarize(task_id, (["a", "b"],), errbacks=[_scan(scan_id)])


def forged_route(task_id: str, scan_id: str) -> Delivery:
    delivery = _summarize(task_id, ([1, 2],))
    return Delivery(**{**vars(delivery), "routing_key": FORGED_QUEUE})


def forged_shutdown(task_id: str) -> Delivery:
    """A remote control ``shutdown`` to every worker, dressed as an entry of a recoverable task."""
    body = {"method": "shutdown", "arguments": {}, "destination": None, "pattern": None, "matcher": None}
    return Delivery(
        body=json.dumps(body),
        body_encoding="utf-8",
        content_type="application/json",
        content_encoding="utf-8",
        headers={"task": "demoapp.summarize", "id": task_id, "clock": 1, "expires": None},
        properties={"delivery_mode": 2},
        exchange="celery.pidbox",
        routing_key="",
        delivery_tag=None,
    )


def _names(embedded: Any) -> set[str]:
    """Every task name a message body would run besides its own (callbacks, errbacks, chain)."""
    if not isinstance(embedded, (list, tuple)) or len(embedded) != 3 or not isinstance(embedded[2], dict):
        return set()
    found = set()
    for key in ("callbacks", "errbacks", "chain"):
        for sig in embedded[2].get(key) or []:
            found.add(sig.get("task"))
    return found


def answering(names: list[str]) -> set[str]:
    return {node for reply in current_app.control.ping(names, timeout=1) for node in reply}


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("make", [forged_callback, forged_chain, forged_errback, forged_route])
def test_a_forged_entry_is_never_sent_to_run_another_task_or_reach_another_queue(
    make: Any, broker_url: str
) -> None:
    task_id, scan_id = str(uuid.uuid4()), str(uuid.uuid4())
    forge(make(task_id, scan_id))

    outcome = outcome_of(sweep_now(), task_id)

    sent = waiting(broker_url, "celery") + waiting(broker_url, FORGED_QUEUE)
    ran = set().union(*(_names(body) for _, body in sent)) if sent else set()
    assert "demoapp.scan" not in ran
    assert [headers["id"] for headers, _ in sent] == []
    assert (outcome.decision.action, outcome.decision.reason) == (Action.REPORT, Reason.UNREADABLE)
    assert outcome.decision.detail == FORGED
    [event] = OrphanEvent.objects.filter(task_id=task_id)
    assert event.action == AuditAction.REPORTED
    sweep_now()  # reported at every sweep, audited once
    assert OrphanEvent.objects.filter(task_id=task_id).count() == 1


@pytest.mark.worker
@pytest.mark.django_db(transaction=True)
def test_a_forged_shutdown_broadcast_leaves_every_worker_up(
    broker_url: str, ledger_redis: Any, workers: Any
) -> None:
    env = {"CELERY_BROKER_URL": broker_url, **ledger_env(ledger_redis)}
    started = [workers.start(name, env=env) for name in ("forged-a@test", "forged-b@test")]
    task_id = forge(forged_shutdown(str(uuid.uuid4())))

    outcome = outcome_of(sweep_now(), task_id)

    # Control messages are handled in order: a shutdown sent by the sweep comes before this ping.
    names = [w.name for w in started]
    wait_for(lambda: answering(names) == set(names), 15, "both workers to answer a ping after the sweep")
    assert all(w.is_running() for w in started)
    assert not any("shutdown from remote" in w.log().lower() for w in started)
    assert (outcome.decision.action, outcome.decision.detail) == (Action.REPORT, FORGED)


@pytest.mark.django_db(transaction=True)
def test_a_sealed_entry_naming_a_pidbox_is_sent_to_its_tasks_own_queue(
    ledger_redis: Any, redis_client: Any
) -> None:
    # A holder of the signing key (or a delivery nobody expected) still cannot route a re-send anywhere
    # but to a queue of the app: the stored exchange and routing key are not trusted.
    task_id = str(uuid.uuid4())
    entry = factories.ledger_entry(forged_shutdown(task_id))

    assert broker.destination(current_app, entry) == ("", "celery")
    routed = factories.ledger_entry(forged_route(task_id, "x"))
    assert broker.destination(current_app, routed) == ("", "celery")
    kept = factories.ledger_entry(_summarize(task_id, ([1],)))
    assert broker.destination(current_app, kept) == ("", "celery")
