"""Orphans made without a worker: a STARTED row and a ledger entry for a node that never answers.

Rows and messages are built the way Celery builds them (``app.amqp.as_task_v2``), so a recovery of one
publishes a message a real worker can run.
"""

from __future__ import annotations

import json
import uuid
from datetime import timedelta
from typing import Any

from celery import current_app
from django.utils import timezone
from django_celery_results.models import TaskResult
from kombu.serialization import dumps

from celery_orphans.entry import HEADER, Delivery, Entry
from celery_orphans.ledger import Ledger
from celery_orphans.seal import signer
from celery_orphans.store import Keys, client

GHOST = "ghost@test"


def delivery(
    name: str,
    task_id: str,
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    content_type: str = "application/json",
    queue: str = "celery",
) -> Delivery:
    message = current_app.amqp.as_task_v2(task_id, name, args, kwargs or {})
    serializer = {"application/json": "json", "application/x-python-serialize": "pickle"}[content_type]
    ctype, encoding, body = dumps(message.body, serializer=serializer)
    return Delivery(
        body=body if isinstance(body, str) else body.decode("latin-1"),
        body_encoding="utf-8",
        content_type=ctype,
        content_encoding=encoding,
        headers=dict(message.headers),
        properties={"correlation_id": task_id, "priority": 0, "delivery_mode": 2},
        exchange="",
        routing_key=queue,
        delivery_tag=None,
    )


def ledger_entry(delivery: Delivery, *, node: str = GHOST, recorded_at: float = 0.0) -> Entry:
    """The ledger entry a worker would write for ``delivery``: its task and id are the message's own."""
    return Entry(
        task_id=delivery.headers["id"],
        task_name=delivery.headers["task"],
        node=node,
        boot="dead-boot",
        recorded_at=recorded_at,
        delivery=delivery,
        token=uuid.uuid4().hex,
    )


def orphan(
    name: str = "demoapp.summarize",
    args: tuple[Any, ...] = ([1, 2],),
    *,
    started_ago: float = 60,
    row: bool = True,
    entry: bool = True,
    worker: str = GHOST,
    content_type: str = "application/json",
    task_id: str | None = None,
) -> str:
    """A task that a dead worker ``worker`` was running ``started_ago`` seconds ago."""
    task_id = task_id or str(uuid.uuid4())
    started = timezone.now() - timedelta(seconds=started_ago)
    if row:
        TaskResult.objects.create(
            task_id=task_id,
            task_name=name,
            status="STARTED",
            worker=worker,
            date_started=started,
            result=json.dumps({"pid": 1, "hostname": worker}),
        )
    if entry:
        made = delivery(name, task_id, args, content_type=content_type)
        Ledger(client(), Keys.current()).admit_delivery(
            ledger_entry(made, node=worker, recorded_at=started.timestamp())
        )
    return task_id


def sealed(text: str) -> str:
    """Entry JSON as a worker holding the signing key stores it: followed by its tag."""
    return signer().sign(text)


def opened(stored: bytes | str) -> Any:
    """The JSON of a stored entry whose tag holds."""
    return json.loads(signer().unsign(stored.decode() if isinstance(stored, bytes) else stored))


# Entries of a made-up task ``demoapp.work``, for the ledger's own tests: no Celery message needed.


def work_delivery(
    *, task_id: str = "t", retries: int = 0, attempt: int | None = None, body: str = '[[1], {"x": 2}, {}]'
) -> Delivery:
    headers: dict[str, Any] = {"id": task_id, "task": "demoapp.work", "retries": retries}
    if attempt is not None:
        headers[HEADER] = {"attempt": attempt, "evidence": "no_reply_no_lease"}
    return Delivery(
        body=body,
        body_encoding="utf-8",
        content_type="application/json",
        content_encoding="utf-8",
        headers=headers,
        properties={"correlation_id": task_id, "priority": 0},
        exchange="",
        routing_key="celery",
        delivery_tag="7",
    )


def work_entry(
    task_id: str, *, recorded_at: float = 1000.0, token: str | None = None, **kwargs: Any
) -> Entry:
    return Entry(
        task_id=task_id,
        task_name="demoapp.work",
        node="celery@host",
        boot="boot-a",
        recorded_at=recorded_at,
        delivery=work_delivery(task_id=task_id, **kwargs),
        token=token if token is not None else uuid.uuid4().hex,
    )
