"""Checkpoints: a recovered task resumes where it left off instead of starting over.

Inside a ``@recoverable`` task bound to ``self``::

    checkpoint = celery_orphans.checkpoint(self)
    start = checkpoint.value or 0           # None on a first run
    for position in range(start, len(ids)):
        process(ids[position])
        checkpoint.save(position + 1)

Why this spelling: Celery hands a bound task everything about the running execution through ``self``
(``self.request``, ``self.retry()``, ``self.update_state()``), and a checkpoint belongs to that execution,
so it is obtained from ``self``. It is a function of ``self`` rather than a new method because
``@recoverable`` marks tasks of any class without changing the class. It returns a handle, the way
``AsyncResult(id)`` does, rather than a load/save pair of functions: the handle reads the last value once
and takes the execution's identity (task id, Celery ``retries``, recovery attempt) once, so every
``save()`` of one execution is fenced by the same identity and can never land under another id.

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
import logging
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, NamedTuple

import redis
from celery import Task

from celery_orphans import registry
from celery_orphans.conf import settings
from celery_orphans.entry import HEADER, recovery_attempt
from celery_orphans.exceptions import CheckpointFenced, CheckpointTooLarge
from celery_orphans.store import Keys, client
from celery_orphans.worker import fence

logger = logging.getLogger(__name__)

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

# Request attributes, set per execution. The first is set by the worker's main process when the ledger
# write found no checkpoint for the task; the second, in the pool process, once this execution read or
# saved one. With the first and without the second a successful execution has nothing to remove.
NO_CHECKPOINT = "celery_orphans_no_checkpoint"
TOUCHED = "celery_orphans_checkpoint_touched"

_REFUSALS = {
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


def execution(task: Task[Any, Any]) -> Execution:
    """The running execution of a task (pass the bound ``self``), to use as a fencing token.

    A store of the task's own that keeps the highest token it has seen, and refuses a write that carries
    a lower one, is safe from a stale execution of the task that outlived its recovery.
    """
    return execution_of(task.request)


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
            logger.warning("celery-orphans: unreadable checkpoint metadata of %s", task_id)
            return None


def _text(outcome: object) -> str:
    return outcome.decode() if isinstance(outcome, bytes) else str(outcome)


class Checkpoint:
    """The checkpoint of one execution of a task: ``value`` to resume from, ``save()`` to move it on."""

    def __init__(
        self,
        task_name: str,
        task_id: str | None,
        execution: tuple[int, int],
        store: CheckpointStore | None,
        request: Any = None,
    ) -> None:
        self.task_name = task_name
        self.task_id = task_id
        self.execution = execution
        self._store = store
        self._request = request
        self._value = None if store is None or task_id is None else store.load(task_id)
        if self._value is not None:
            self._touch()

    def _touch(self) -> None:
        if self._request is not None:
            setattr(self._request, TOUCHED, True)

    @property
    def value(self) -> Any:
        """The last value saved under this task id, ``None`` when there is none (a first run)."""
        return self._value

    def save(self, value: Any) -> None:
        """Replace the checkpoint with ``value``, which must be JSON-serializable, in one Redis write.

        Raises ``CheckpointTooLarge`` when its JSON exceeds ``CELERY_ORPHANS_CHECKPOINT_MAX_BYTES``, and
        ``CheckpointFenced`` when a newer execution owns the task; left uncaught, that one ends this
        execution quietly. ``value`` then reads what a resumed run would read (a tuple as a list).
        """
        encoded = json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
        limit = settings.CHECKPOINT_MAX_BYTES
        if len(encoded) > limit:
            raise CheckpointTooLarge(
                f"checkpoint of {self.task_name}[{self.task_id}] is {len(encoded)} bytes of JSON, over "
                f"CELERY_ORPHANS_CHECKPOINT_MAX_BYTES ({limit}); save where you are (an id, an offset), "
                "not the data"
            )
        if self._request is not None and fence.forfeit(self._request):
            message = (
                f"{self.task_name}[{self.task_id}] may not save a checkpoint: its worker gave it up (its "
                "lease was not renewed in time) and the task is recovered from the ledger"
            )
            logger.warning("celery-orphans: %s; stopping this execution", message)
            raise CheckpointFenced(message)
        if self._store is not None and self.task_id is not None:
            self._touch()  # before the write: a save that reached Redis but timed out still counts
            outcome = self._store.save(self.task_id, self.execution, encoded)
            if outcome != "saved":
                retries, attempt = self.execution
                message = (
                    f"{self.task_name}[{self.task_id}] (retries {retries}, recovery attempt {attempt}) "
                    f"may not save a checkpoint: {_REFUSALS.get(outcome, outcome)}"
                )
                logger.warning("celery-orphans: %s; stopping this execution", message)
                raise CheckpointFenced(message)
        self._value = json.loads(encoded)


def checkpoint(task: Task[Any, Any]) -> Checkpoint:
    """The checkpoint of the running execution of a ``@recoverable`` task: pass the bound ``self``.

    A task called directly or applied eagerly runs in the caller's process, where no worker can die
    under it: its checkpoint lives in memory, for that call only.
    """
    if registry.policy_of(task) is None:
        raise TypeError(
            f"celery_orphans.checkpoint() needs a @recoverable task; {getattr(task, 'name', task)!r} "
            "is not marked @recoverable."
        )
    request = task.request
    execution = execution_of(request)
    if request.id is None or request.called_directly or request.is_eager:
        return Checkpoint(task.name, request.id, execution, store=None)
    return Checkpoint(task.name, request.id, execution, CheckpointStore(client(), Keys.current()), request)


def discard_finished(task: Any, request: Any, task_id: str | None = None) -> None:
    """Drop the checkpoint of a task that ended, unless a newer execution of it wrote one since."""
    if task is None or request is None or registry.policy_of(task) is None:
        return
    task_id = task_id or getattr(request, "id", None)
    if not task_id:
        return
    if getattr(request, "id", None) == task_id:
        if getattr(request, "is_eager", False):
            return
        execution = execution_of(request)
    else:
        # Celery sent the signal without the request (a hard time limit): assume the oldest
        # execution, so a newer one's checkpoint is kept; the TTL removes it otherwise.
        execution = Execution(0, 0)
    try:
        outcome = CheckpointStore(client(), Keys.current()).discard(task_id, execution)
    except redis.RedisError as exc:
        logger.warning("celery-orphans: cannot remove the checkpoint of %s[%s]: %s", task.name, task_id, exc)
        return
    if outcome != "discarded":
        logger.info(
            "celery-orphans: kept the checkpoint of %s[%s]: %s",
            task.name,
            task_id,
            _REFUSALS.get(outcome, outcome),
        )


def on_task_success(sender: Any = None, **kwargs: Any) -> None:
    request = getattr(sender, "request", None)
    # Sent in the process that ran the task, with that execution's own request: if no checkpoint
    # existed when it began and it saved none, there is nothing to remove (one Redis call saved per
    # task). Only here: a revoke or a time limit is signalled from the worker's main process, whose
    # copy of the request never learns of a save.
    if getattr(request, NO_CHECKPOINT, False) is True and not getattr(request, TOUCHED, False):
        return
    discard_finished(sender, request)


def on_task_failure(sender: Any = None, task_id: str | None = None, **kwargs: Any) -> None:
    discard_finished(sender, getattr(sender, "request", None), task_id)


def on_task_revoked(sender: Any = None, request: Any = None, **kwargs: Any) -> None:
    discard_finished(sender, request)
