"""What the sweep does through the broker: publish a delivery again, forget a dead one, revoke."""

from __future__ import annotations

import json
import logging
from typing import Any

from celery import Celery

from celery_orphans.ledger import HEADER, Entry
from celery_orphans.reconcile import SAFE_CONTENT_TYPES

logger = logging.getLogger(__name__)


def publish(app: Celery, entry: Entry, recovery: dict[str, Any]) -> None:
    """Send the entry's delivery again, byte for byte, with the recovery metadata added to its headers.

    Same id, same body (arguments, chain, callbacks, errbacks, chord), same exchange and routing key,
    same priority: the re-run takes the place of the lost one.
    """
    delivery = entry.delivery
    if delivery.content_type not in SAFE_CONTENT_TYPES:
        raise ValueError(f"refusing to send a {delivery.content_type or 'untyped'} message again")
    # Reading the ledger refuses such an entry already; checked again here because a worker runs what
    # the headers name, whatever the entry says was recovered.
    if delivery.headers.get("task") != entry.task_name or delivery.headers.get("id") != entry.task_id:
        raise ValueError(f"refusing to send a message that does not run {entry.task_name}[{entry.task_id}]")
    headers = {**delivery.headers, HEADER: recovery}
    with app.producer_or_acquire() as producer:
        producer.publish(
            delivery.raw_body(),
            exchange=delivery.exchange,
            routing_key=delivery.routing_key,
            headers=headers,
            content_type=delivery.content_type,
            content_encoding=delivery.content_encoding,
            retry=True,
            retry_policy={"max_retries": 3, "interval_start": 0.2, "interval_step": 0.5},
            **delivery.properties,
        )


def discard_unacked(app: Celery, task_id: str, delivery_tag: str | None) -> bool:
    """Remove a dead delivery of ``task_id`` from the Redis transport's ``unacked`` hash.

    Left there, the transport would restore it once ``visibility_timeout`` passes. Returns whether
    anything was removed; on other transports there is nothing to do.
    """
    with app.connection_for_write() as conn:
        channel: Any = conn.default_channel
        unacked_key = getattr(channel, "unacked_key", None)
        redis_client = getattr(channel, "client", None)
        if unacked_key is None or redis_client is None:
            return False
        tags = [delivery_tag] if delivery_tag else _tags_of(redis_client, unacked_key, task_id)
        removed = 0
        for tag in tags:
            pipe = redis_client.pipeline()
            pipe.zrem(channel.unacked_index_key, tag).hdel(unacked_key, tag)
            removed += int(pipe.execute()[1])
        return removed > 0


def _tags_of(redis_client: Any, unacked_key: str, task_id: str) -> list[str]:
    tags = []
    for tag, payload in redis_client.hscan_iter(unacked_key):
        try:
            message = json.loads(payload)[0]
            found = message.get("headers", {}).get("id")
        except (ValueError, TypeError, IndexError, AttributeError):
            continue
        if found == task_id:
            tags.append(tag.decode() if isinstance(tag, bytes) else str(tag))
    return tags


def revoke(app: Celery, task_id: str) -> None:
    """Tell every worker to discard any copy of a task that must never run again."""
    app.control.revoke(task_id)
