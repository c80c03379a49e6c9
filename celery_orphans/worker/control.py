"""A remote control command that flags tasks revoked on a worker and leaves their result rows alone, and
the one that takes the flag off again when an operator lifts a task's recovery cap.

Celery's own ``revoke`` command does more on some versions: Celery 5.6's workers store ``REVOKED`` in
the result backend for every id they are sent, even over a finished row, so a task celery-orphans has
just marked ``FAILURE`` (terminal) would end ``REVOKED``, its reason lost. This command only adds the
ids to the worker's revoked set, where ``Request.revoked()`` finds them and drops any copy that arrives
(the same set Celery's command fills, and its ``inspect revoked`` lists). Registered when the Django app
is ready, so every worker that runs celery-orphans knows it.
"""

from __future__ import annotations

from typing import Any

from celery.utils.functional import maybe_list
from celery.worker import state as worker_state
from celery.worker.control import control_command

from celery_orphans.recovery.broker import REVOKE_COMMAND, UNREVOKE_COMMAND


@control_command(name=REVOKE_COMMAND, args=[("task_ids", list)], signature="<task_id> [task_id ...]")
def revoke(state: Any, task_ids: list[str], **kwargs: Any) -> dict[str, str]:
    """Flag tasks revoked on this worker without touching their results."""
    ids = maybe_list(task_ids) or []
    worker_state.revoked.update(ids)
    return {"ok": f"{len(ids)} tasks flagged as revoked"}  # a reply as Celery's commands give one


@control_command(name=UNREVOKE_COMMAND, args=[("task_ids", list)], signature="<task_id> [task_id ...]")
def unrevoke(state: Any, task_ids: list[str], **kwargs: Any) -> dict[str, str]:
    """Take tasks off this worker's revoked set: an operator lifted their recovery cap, and the copy a
    sweep sends next must run, not be dropped as revoked."""
    ids = maybe_list(task_ids) or []
    for task_id in ids:
        worker_state.revoked.discard(task_id)
    return {"ok": f"{len(ids)} tasks no longer flagged as revoked"}
