"""Executions that ended without writing a state: their ``STARTED`` row is no running execution's.

A task body that ends with ``Ignore`` (``Task.replace()`` raises it once the replacement is sent) or
``Reject`` stores no state, so its result row stays ``STARTED``, naming the node that ran it, until a later
execution of the same id writes over it (a replacement's last task, a requeued message) or for good. Asked,
that node no longer holds the id. Plain Celery leaves such a row alone, and so must a sweep: the pool process
records here that the execution ended, and the sweep passes over a row that no execution has started since.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from datetime import timezone as dt_timezone

import redis

from celery_orphans.store import Keys

# How long the record of an ending is kept when the app gives no result expiry: a row Celery's cleanup
# has not removed by then is judged again.
DEFAULT_TTL_SECONDS = 86_400
# The row's start is written by the same process before the body runs; allow for a clock step between.
_SLACK_SECONDS = 1.0


@dataclass(frozen=True)
class Ending:
    node: str
    at: float  # seconds since the epoch, by the clock of the process that ran the execution

    def covers(self, worker: str | None, started_at: datetime | None) -> bool:
        """Whether a row naming ``worker`` and started at ``started_at`` is the execution that ended."""
        if worker != self.node or started_at is None:
            return False
        return started_at <= datetime.fromtimestamp(self.at + _SLACK_SECONDS, tz=dt_timezone.utc)


def _key(keys: Keys, task_id: str) -> str:
    return f"{keys.prefix}:ended:{task_id}"


def write(client: redis.Redis[bytes], keys: Keys, task_id: str, node: str, ttl: int) -> None:
    """Record that the execution of ``task_id`` on ``node`` ended without a state."""
    value = json.dumps({"node": node, "at": time.time()})
    client.set(_key(keys, task_id), value, ex=max(1, ttl))


def read(client: redis.Redis[bytes], keys: Keys, task_ids: Iterable[str]) -> dict[str, Ending]:
    """The recorded endings of ``task_ids``, in one call; ids without a readable one are left out."""
    ids = list(task_ids)
    if not ids:
        return {}
    found: dict[str, Ending] = {}
    for task_id, raw in zip(ids, client.mget([_key(keys, t) for t in ids]), strict=True):
        if raw is None:
            continue
        try:
            value = json.loads(raw)
            found[task_id] = Ending(str(value["node"]), float(value["at"]))
        except (ValueError, KeyError, TypeError):
            continue  # not ours to judge: the row is then judged as any other
    return found
