"""What the sweep does through the broker: publish a delivery again, forget a dead one, revoke."""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any

from celery import Celery
from kombu import Connection

from celery_orphans.entry import HEADER, Entry
from celery_orphans.rules import SAFE_CONTENT_TYPES


class UnsafeMessage(ValueError):
    """The entry's message may not be sent again: a content type that could run code, or headers that
    would run another task than the entry names."""


def destination(app: Celery, entry: Entry) -> tuple[str, str]:
    """The exchange and routing key a recovery is sent to: a task queue the app declares, never a route
    named only by stored data (a pidbox, the events exchange, a queue of the writer's choosing).

    The delivery's own route is kept when it reaches one of the app's queues (a caller's
    ``apply_async(queue=...)``); otherwise the message goes where the app's router sends the task.
    """
    exchange, routing_key = entry.delivery.exchange, entry.delivery.routing_key
    for queue in app.amqp.queues.values():
        own = queue.exchange.name if queue.exchange is not None else ""
        if (exchange, routing_key) in ((own, queue.routing_key), ("", queue.name)):
            return exchange, routing_key
    # What Task.apply_async gives the router: the task's own routing attributes.
    task = app.tasks.get(entry.task_name)
    options = {name: getattr(task, name, None) for name in ("queue", "exchange", "routing_key")}
    route = app.amqp.router.route({k: v for k, v in options.items() if v}, entry.task_name)
    queue = route.get("queue") or app.amqp.default_queue
    named, key = route.get("exchange"), route.get("routing_key")
    exchange = str(getattr(named, "name", named) or "")
    # As Celery's send_task_message does: a direct queue is reached by its name on the default exchange.
    if not exchange and not key and queue.exchange.type == "direct":
        return "", str(queue.name)
    return exchange or str(queue.exchange.name), str(key or queue.routing_key)


def publish(app: Celery, entry: Entry, recovery: dict[str, Any]) -> None:
    """Send the entry's delivery again, byte for byte, with the recovery metadata added to its headers.

    Same id, same body (arguments, chain, callbacks, errbacks, chord), same priority, to the task's
    queue (``destination``): the re-run takes the place of the lost one. The body is the one the worker
    admitted and sealed (``entry.py``); an entry whose seal fails never gets here.
    """
    delivery = entry.delivery
    if delivery.content_type not in SAFE_CONTENT_TYPES:
        raise UnsafeMessage(f"refusing to send a {delivery.content_type or 'untyped'} message again")
    # Reading the ledger refuses such an entry already; checked again here because a worker runs what
    # the headers name, whatever the entry says was recovered.
    if delivery.headers.get("task") != entry.task_name or delivery.headers.get("id") != entry.task_id:
        raise UnsafeMessage(
            f"refusing to send a message that does not run {entry.task_name}[{entry.task_id}]"
        )
    headers = {**delivery.headers, HEADER: recovery}
    exchange, routing_key = destination(app, entry)
    with app.producer_or_acquire() as producer:
        producer.publish(
            delivery.raw_body(),
            exchange=exchange,
            routing_key=routing_key,
            headers=headers,
            content_type=delivery.content_type,
            content_encoding=delivery.content_encoding,
            retry=True,
            retry_policy={"max_retries": 3, "interval_start": 0.2, "interval_step": 0.5},
            **delivery.properties,
        )


def unacked_tags(conn: Connection) -> dict[str, list[str]]:
    """The delivery tags in the Redis transport's ``unacked`` hash, by task id; empty on other transports.

    One scan of the hash, for every task a sweep finds without a ledger entry (which would name its tag).
    """
    found: dict[str, list[str]] = {}
    channel: Any = conn.default_channel
    if getattr(channel, "unacked_key", None) is None:
        return found
    for tag, payload in channel.client.hscan_iter(channel.unacked_key, count=1000):
        try:
            task_id = json.loads(payload)[0]["headers"]["id"]
        except (ValueError, TypeError, LookupError):
            continue
        if isinstance(task_id, str):
            found.setdefault(task_id, []).append(tag.decode() if isinstance(tag, bytes) else str(tag))
    return found


def discard_unacked(conn: Connection, tags: Collection[str]) -> int:
    """Remove dead deliveries from the Redis transport's ``unacked`` hash; how many were there.

    Left there, the transport would restore them once ``visibility_timeout`` passes. On other transports
    there is nothing to do. ``conn`` is a connection of the caller's own, never one of the app's pool:
    the transport's channel there may be waiting on a ``BRPOP`` of its own client.
    """
    if not tags:
        return 0
    channel: Any = conn.default_channel
    if getattr(channel, "unacked_key", None) is None:
        return 0
    pipe = channel.client.pipeline()
    pipe.zrem(channel.unacked_index_key, *tags).hdel(channel.unacked_key, *tags)
    return int(pipe.execute()[1])


# Ids per revoke broadcast: every worker reads each one whole.
REVOKE_CHUNK = 1000
# The remote control command each worker answers by flagging the ids revoked (worker/control.py).
REVOKE_COMMAND = "celery_orphans_revoke"
# ... and the one that takes that flag off again, when an operator lifts a task's recovery cap.
UNREVOKE_COMMAND = "celery_orphans_unrevoke"


def revoke(app: Celery, task_ids: list[str]) -> None:
    """Tell every worker to discard any copy of these tasks, which must never run again, leaving their
    result rows as they are (worker/control.py)."""
    for start in range(0, len(task_ids), REVOKE_CHUNK):
        app.control.broadcast(REVOKE_COMMAND, arguments={"task_ids": task_ids[start : start + REVOKE_CHUNK]})


def unrevoke(app: Celery, task_ids: list[str]) -> None:
    """Tell every worker to take these tasks off its revoked set (worker/control.py): their recovery cap
    was lifted, and the copy a sweep sends next must run."""
    for start in range(0, len(task_ids), REVOKE_CHUNK):
        app.control.broadcast(
            UNREVOKE_COMMAND, arguments={"task_ids": task_ids[start : start + REVOKE_CHUNK]}
        )
