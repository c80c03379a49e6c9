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
"""

from __future__ import annotations

import json
from typing import Any

from celery import Task

from celery_orphans import logs, registry
from celery_orphans.checkpoints import REFUSALS, CheckpointStore, Execution, execution_of
from celery_orphans.conf import settings
from celery_orphans.exceptions import CheckpointFenced, CheckpointTooLarge
from celery_orphans.store import Keys, client
from celery_orphans.worker import forfeit

logger = logs.get(__name__)

# Request attributes, set per execution. The first is set by the worker's main process when the ledger
# write found no checkpoint for the task; the second, in the pool process, once this execution read or
# saved one. With the first and without the second a successful execution has nothing to remove.
NO_CHECKPOINT = "celery_orphans_no_checkpoint"
TOUCHED = "celery_orphans_checkpoint_touched"


def execution(task: Task[Any, Any]) -> Execution:
    """The running execution of a task (pass the bound ``self``), to use as a fencing token.

    A store of the task's own that keeps the highest token it has seen, and refuses a write that carries
    a lower one, is safe from a stale execution of the task that outlived its recovery.
    """
    return execution_of(task.request)


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
        if self._request is not None and forfeit.is_forfeit(self._request):
            message = (
                f"{self.task_name}[{self.task_id}] may not save a checkpoint: its worker gave it up (its "
                "lease was not renewed in time) and the task is recovered from the ledger"
            )
            logger.warning("%s; stopping this execution", message)
            raise CheckpointFenced(message)
        if self._store is not None and self.task_id is not None:
            self._touch()  # before the write: a save that reached Redis but timed out still counts
            outcome = self._store.save(self.task_id, self.execution, encoded)
            if outcome != "saved":
                retries, attempt = self.execution
                message = (
                    f"{self.task_name}[{self.task_id}] (retries {retries}, recovery attempt {attempt}) "
                    f"may not save a checkpoint: {REFUSALS.get(outcome, outcome)}"
                )
                logger.warning("%s; stopping this execution", message)
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
    with logs.redis_fault_let_go(logger, "cannot remove the checkpoint of %s[%s]", task.name, task_id):
        outcome = CheckpointStore(client(), Keys.current()).discard(task_id, execution)
        if outcome != "discarded":
            logger.info(
                "kept the checkpoint of %s[%s]: %s", task.name, task_id, REFUSALS.get(outcome, outcome)
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
