"""A pool process that dies under a recoverable task: recovered by its own worker, and capped."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from billiard.einfo import ExceptionWithTraceback  # type: ignore[attr-defined]
from billiard.exceptions import Terminated, WorkerLostError

from celery_orphans.exceptions import RecoveryLimitReached
from celery_orphans.models import OrphanEvent
from celery_orphans.worker import pool_loss
from tests.helpers import starts

pytestmark = pytest.mark.worker


def test_task_whose_pool_process_dies_once_is_sent_again_by_the_worker_itself(workers):
    from demoapp.tasks import lose_pool_process

    workers.start("oom@test")
    result = lose_pool_process.delay(times=1)

    assert result.get(timeout=30) == "survived"
    assert starts(result.id) == 2
    [event] = OrphanEvent.objects.filter(task_id=result.id)
    assert (event.action, event.evidence, event.trigger, event.attempt) == (
        "recovered",
        "pool_child_lost",
        "worker",
        1,
    )
    assert event.detail.endswith("its pool process ended: signal 9 (SIGKILL)"), event.detail


def test_task_that_kills_its_pool_process_every_time_stops_after_max_attempts(workers):
    from demoapp.tasks import lose_pool_process

    workers.start("oom@test")
    result = lose_pool_process.delay()  # @recoverable(max_attempts=2)

    with pytest.raises(RecoveryLimitReached):
        result.get(timeout=40)
    assert starts(result.id) == 3
    assert list(
        OrphanEvent.objects.filter(task_id=result.id).order_by("id").values_list("action", flat=True)
    ) == ["recovered", "recovered", "marked_terminal"]


def test_with_celerys_task_retry_on_worker_lost_the_extension_alone_sends_the_task_again(
    workers, redis_client
):
    # Celery 5.7 would send it again itself, with retries + 1 and a RETRY state between; on_failure takes
    # the loss first, so one of the two acts: the extension, under its own cap.
    from demoapp.noharm import lose_pool_process, runs

    workers.start("lost@test", include=("demoapp.noharm",))
    result = lose_pool_process.delay()  # retry_on_worker_lost=True, max_retries=1

    assert result.get(timeout=30) == "survived"
    assert [r["note"] for r in runs(result.id)] == ["killed", ""]
    assert redis_client.lrange(f"noharm:retries:{result.id}", 0, -1) == [b"0", b"0"]  # not Celery's retry
    [event] = OrphanEvent.objects.filter(task_id=result.id)
    assert (event.action, event.evidence, event.trigger) == ("recovered", "pool_child_lost", "worker")
    assert event.detail.endswith("its pool process ended: signal 9 (SIGKILL)"), event.detail


# --- what the worker's main process reads of a lost pool process, without a worker ----------------------


def wrapped(exc: BaseException) -> ExceptionWithTraceback:
    """``exc`` as the pool hands a task's failure to the main process."""
    try:
        raise exc
    except BaseException as raised:
        return ExceptionWithTraceback(raised, raised.__traceback__)


def test_the_exit_status_is_read_from_billiards_message_or_from_the_exit_code():
    sigkill = WorkerLostError("Worker exited prematurely: signal 9 (SIGKILL) Job: 0.")

    assert pool_loss.exit_status(sigkill) == "signal 9 (SIGKILL)"
    assert pool_loss.exit_status(wrapped(sigkill)) == "signal 9 (SIGKILL)"
    assert pool_loss.exit_status(WorkerLostError("Worker exited prematurely: exitcode 1.")) == "exitcode 1"
    assert pool_loss.exit_status(SystemExit(3)) == "exitcode 3"
    assert pool_loss.exit_status(SystemExit("not a code")) == "exitcode 1"
    assert pool_loss.exit_status(WorkerLostError("Worker exited without a status")) is None


def test_a_lost_pool_process_is_a_pool_loss_unless_the_request_was_cancelled_or_revoked():
    lost = WorkerLostError("Worker exited prematurely: signal 9 (SIGKILL) Job: 0.")
    running = SimpleNamespace(_already_cancelled=False, _already_revoked=False)

    assert pool_loss.is_pool_loss(running, lost)
    assert pool_loss.is_pool_loss(running, wrapped(lost))
    assert pool_loss.is_pool_loss(running, SystemExit(1))
    assert not pool_loss.is_pool_loss(running, Terminated(9))  # revoked with terminate=True
    assert not pool_loss.is_pool_loss(running, RuntimeError("the body raised"))
    assert not pool_loss.is_pool_loss(SimpleNamespace(_already_cancelled=True, _already_revoked=False), lost)
    assert not pool_loss.is_pool_loss(SimpleNamespace(_already_cancelled=False, _already_revoked=True), lost)
