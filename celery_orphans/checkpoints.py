"""Checkpoints as Redis keeps them: one hash per task id, written by one fenced Lua call.

Storage: one Redis hash per task id, ``{prefix}:checkpoint:{id}``, holding the JSON value and who wrote
it. A recovery or a Celery retry runs under the same id and so reads it; a new call of the task has a
new id and reads ``None``. It is removed when the task succeeds, fails for good or is revoked, and
expires ``CHECKPOINT_TTL_SECONDS`` after its last save in any case.

Fencing: an execution is identified by ``(retries, attempt)``, ordered as the ledger's fence orders
copies of a task (more Celery retries is newer whatever the attempt; at equal retries the higher
recovery attempt is newer). ``save()`` is one Lua call that refuses a write from an execution older
than the task's fence (it was recovered or marked terminal since this execution began) or older than
the one that last wrote, and raises ``CheckpointFenced``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, NamedTuple

import redis

from celery_orphans import logs
from celery_orphans.conf import settings
from celery_orphans.entry import HEADER, recovery_attempt
from celery_orphans.store import Keys

logger = logs.get(__name__)

# KEYS: the task's fence, its checkpoint. ARGV[1..2]: the caller's retries and recovery attempt.
# Returns a reason when the caller is older than the fence or than the checkpoint's last writer.
_REFUSE_OLDER = """
local function older(r, a, r2, a2) return r < r2 or (r == r2 and a < a2) end
local retries, attempt = tonumber(ARGV[1]), tonumber(ARGV[2])
local f = redis.call('HMGET', KEYS[1], 'attempts', 'retries', 'terminal')
local fence_attempts = tonumber(f[1]) or 0
local fence_retries = tonumber(f[2]) or -1
if f[3] == '1' and retries <= fence_retries then return 'terminal' end
if older(retries, attempt, fence_retries, fence_attempts) then return 'recovered' end
local w = redis.call('HMGET', KEYS[2], 'retries', 'attempt')
if w[1] and older(retries, attempt, tonumber(w[1]), tonumber(w[2]) or 0) then return 'newer' end
"""

# ARGV[3..6]: the JSON value, the time of the save, its size in bytes, the TTL in seconds.
_SAVE = (
    _REFUSE_OLDER
    + """
redis.call('HSET', KEYS[2], 'value', ARGV[3], 'retries', retries, 'attempt', attempt,
           'saved_at', ARGV[4], 'size', ARGV[5])
redis.call('EXPIRE', KEYS[2], ARGV[6])
return 'saved'
"""
)

_DISCARD = (
    _REFUSE_OLDER
    + """
redis.call('DEL', KEYS[2])
return 'discarded'
"""
)

REFUSALS = {
    "terminal": "the task was marked terminal",
    "recovered": "the task was recovered and a newer execution owns it",
    "newer": "a newer execution of the task has saved a checkpoint since",
}


@dataclass(frozen=True)
class Saved:
    """When a task's checkpoint was last saved, and its size in bytes of JSON."""

    at: datetime
    size: int


class Execution(NamedTuple):
    """Which execution of a task id runs: ``(retries, recovery attempt)``. A later one compares higher."""

    retries: int
    attempt: int


def execution_of(request: Any) -> Execution:
    """The execution a Celery request context describes."""
    retries = getattr(request, "retries", 0)
    retries = retries if isinstance(retries, int) and not isinstance(retries, bool) else 0
    return Execution(retries, recovery_attempt({HEADER: getattr(request, HEADER, None)}))


class CheckpointStore:
    """Checkpoint operations against one Redis client and key prefix."""

    def __init__(self, redis_client: redis.Redis[bytes], keys: Keys) -> None:
        self.client = redis_client
        self.keys = keys
        self._save = redis_client.register_script(_SAVE)
        self._discard = redis_client.register_script(_DISCARD)

    def load(self, task_id: str) -> Any:
        raw = self.client.hget(self.keys.checkpoint(task_id), "value")
        return None if raw is None else json.loads(raw)

    def save(self, task_id: str, execution: tuple[int, int], encoded: bytes) -> str:
        """Write ``encoded`` for ``execution``; returns ``"saved"`` or the reason it was refused."""
        outcome = self._save(
            keys=[self.keys.fence(task_id), self.keys.checkpoint(task_id)],
            args=[*execution, encoded, time.time(), len(encoded), settings.CHECKPOINT_TTL_SECONDS],
        )
        return _text(outcome)

    def discard(self, task_id: str, execution: tuple[int, int]) -> str:
        """Remove the checkpoint unless an execution newer than ``execution`` wrote it or owns the task."""
        outcome = self._discard(
            keys=[self.keys.fence(task_id), self.keys.checkpoint(task_id)], args=[*execution]
        )
        return _text(outcome)

    def forget(self, task_id: str) -> None:
        """Remove the checkpoint whoever wrote it: the task will never run again."""
        self.client.delete(self.keys.checkpoint(task_id))

    def last_saved(self, task_id: str) -> Saved | None:
        at, size = self.client.hmget(self.keys.checkpoint(task_id), ["saved_at", "size"])
        if at is None or size is None:
            return None
        try:
            return Saved(datetime.fromtimestamp(float(at), tz=timezone.utc), int(size))
        except (ValueError, OverflowError, OSError):
            logger.warning("unreadable checkpoint metadata of %s", task_id)
            return None


def _text(outcome: object) -> str:
    return outcome.decode() if isinstance(outcome, bytes) else str(outcome)
