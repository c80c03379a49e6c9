"""Checkpoints: saved and fenced against real Redis, resumed after a real SIGKILL."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Any

import pytest
from django_celery_results.models import TaskResult

import celery_orphans
from celery_orphans.checkpoints import CheckpointStore, Saved
from celery_orphans.decision import Action
from celery_orphans.exceptions import CheckpointFenced, CheckpointTooLarge
from celery_orphans.ledger import Ledger
from celery_orphans.models import OrphanEvent
from celery_orphans.recovery.claims import ALL_RETRIES
from celery_orphans.scripts import ClaimMode
from celery_orphans.store import Keys, client
from celery_orphans.worker.checkpoint import on_task_failure, on_task_success
from tests.helpers import started_on, sweep_until, wait_for


def store() -> CheckpointStore:
    return CheckpointStore(client(), Keys.current())


def ledger() -> Ledger:
    return Ledger(client(), Keys.current())


def task() -> Any:
    from demoapp.tasks import count_steps

    return count_steps._get_current_object()


@contextmanager
def executing(task_id: str, *, retries: int = 0, attempt: int | None = None) -> Iterator[Any]:
    """The request context a worker gives ``count_steps`` while it runs one execution of ``task_id``."""
    recovery = {} if attempt is None else {"celery_orphans": {"attempt": attempt}}
    t = task()
    t.push_request(id=task_id, retries=retries, called_directly=False, is_eager=False, **recovery)
    try:
        yield t
    finally:
        t.pop_request()


def save_as(task_id: str, value: object, *, retries: int = 0, attempt: int | None = None) -> None:
    with executing(task_id, retries=retries, attempt=attempt) as t:
        celery_orphans.checkpoint(t).save(value)


def recover(task_id: str, attempts: int = 0, retries: int = 0) -> int:
    """Raise the task's fence exactly as a sweep's recovery claim does."""
    claimed = ledger().claim(
        task_id, token="", attempts=attempts, retries=retries, ttl=60, mode=ClaimMode.RECOVER
    )
    assert claimed is not None
    return claimed


# -- the API against real Redis --


def test_first_run_reads_none_and_a_later_execution_of_the_same_id_reads_the_last_save(redis_client):
    with executing("t-1") as t:
        checkpoint = celery_orphans.checkpoint(t)
        assert checkpoint.value is None
        checkpoint.save({"last_id": 41})
        checkpoint.save({"last_id": 42})
        assert checkpoint.value == {"last_id": 42}
    recover("t-1")
    with executing("t-1", attempt=1) as t:
        assert celery_orphans.checkpoint(t).value == {"last_id": 42}


def test_new_call_of_the_same_task_reads_none_while_another_id_has_a_checkpoint(redis_client):
    save_as("t-old", 150)
    with executing("t-new") as t:
        assert celery_orphans.checkpoint(t).value is None
    assert store().load("t-old") == 150


def test_value_reads_back_as_a_resumed_run_would_read_it(redis_client):
    with executing("t-json") as t:
        checkpoint = celery_orphans.checkpoint(t)
        checkpoint.save({"pair": (1, 2), "name": "é"})
        assert checkpoint.value == {"pair": [1, 2], "name": "é"}
    assert store().load("t-json") == {"pair": [1, 2], "name": "é"}


def test_value_that_is_not_json_raises_and_saves_nothing(redis_client):
    with executing("t-bad") as t:
        checkpoint = celery_orphans.checkpoint(t)
        with pytest.raises(TypeError):
            checkpoint.save({"when": datetime.now(timezone.utc)})
        with pytest.raises(ValueError, match="Out of range float"):
            checkpoint.save(float("nan"))
    assert not redis_client.exists(Keys.current().checkpoint("t-bad"))


def test_checkpoint_over_the_size_limit_raises_and_keeps_the_last_one(redis_client, settings):
    settings.CELERY_ORPHANS_CHECKPOINT_MAX_BYTES = 20
    with executing("t-big") as t:
        checkpoint = celery_orphans.checkpoint(t)
        checkpoint.save("x" * 18)  # 20 bytes of JSON with its quotes: at the limit
        with pytest.raises(
            CheckpointTooLarge, match=r"21 bytes of JSON, over CELERY_ORPHANS_CHECKPOINT_MAX_BYTES \(20\)"
        ):
            checkpoint.save("y" * 19)
        assert checkpoint.value == "x" * 18
    assert store().load("t-big") == "x" * 18
    assert store().last_saved("t-big").size == 20


def test_checkpoint_expires_after_the_ttl_renewed_by_each_save(redis_client, settings):
    settings.CELERY_ORPHANS_CHECKPOINT_TTL_SECONDS = 120
    save_as("t-ttl", 1)
    key = Keys.current().checkpoint("t-ttl")
    redis_client.expire(key, 5)
    save_as("t-ttl", 2)
    assert 110 < redis_client.ttl(key) <= 120


def test_last_saved_reports_time_and_size_of_the_last_save(redis_client):
    before = datetime.now(timezone.utc)
    save_as("t-meta", {"last_id": 12345})
    saved = store().last_saved("t-meta")
    assert isinstance(saved, Saved)
    assert saved.size == len(json.dumps({"last_id": 12345}, separators=(",", ":")))
    assert before <= saved.at <= datetime.now(timezone.utc)
    assert store().last_saved("t-none") is None


def test_settings_default_to_a_week_and_64_kib(monkeypatch):
    from celery_orphans.conf import settings

    monkeypatch.delenv("CELERY_ORPHANS_CHECKPOINT_TTL_SECONDS", raising=False)
    monkeypatch.delenv("CELERY_ORPHANS_CHECKPOINT_MAX_BYTES", raising=False)
    assert settings.CHECKPOINT_TTL_SECONDS == 7 * 24 * 3600
    assert settings.CHECKPOINT_MAX_BYTES == 65_536


# -- fencing --


def test_write_from_an_older_recovery_attempt_than_the_last_writer_is_refused(redis_client):
    save_as("t-race", 10, attempt=2)
    with pytest.raises(CheckpointFenced, match="a newer execution of the task has saved a checkpoint since"):
        save_as("t-race", 99, attempt=1)
    with pytest.raises(CheckpointFenced):
        save_as("t-race", 99)  # the original run, before any recovery
    assert store().load("t-race") == 10


def test_execution_older_than_the_fence_may_not_write_even_before_the_recovered_run_has(redis_client):
    save_as("t-fence", 5)
    recover("t-fence")
    with pytest.raises(CheckpointFenced, match="the task was recovered and a newer execution owns it"):
        save_as("t-fence", 6)
    save_as("t-fence", 7, attempt=1)
    assert store().load("t-fence") == 7


def test_celery_retry_of_an_execution_is_newer_whatever_its_recovery_attempt(redis_client):
    save_as("t-retry", 1)
    recover("t-retry")
    save_as("t-retry", 2, attempt=1)
    save_as("t-retry", 3, retries=1)  # Task.retry() sent without the recovery header
    with pytest.raises(CheckpointFenced):
        save_as("t-retry", 4, retries=0, attempt=1)
    assert store().load("t-retry") == 3


def test_task_marked_terminal_refuses_every_write(redis_client):
    ledger().claim("t-term", token="", attempts=0, retries=ALL_RETRIES, ttl=60, mode=ClaimMode.TERMINAL)
    with pytest.raises(CheckpointFenced, match="the task was marked terminal"):
        save_as("t-term", 1, retries=5, attempt=3)
    assert not redis_client.exists(Keys.current().checkpoint("t-term"))


def test_fenced_save_is_a_celery_ignore_so_the_stale_execution_writes_no_result():
    from celery.exceptions import Ignore

    assert issubclass(CheckpointFenced, Ignore)
    assert issubclass(CheckpointFenced, celery_orphans.CeleryOrphansError)


# -- lifecycle, through the signal receivers --


def test_finished_execution_removes_its_checkpoint(redis_client):
    save_as("t-done", 3)
    with executing("t-done") as t:
        on_task_success(sender=t, result=3)
    assert store().load("t-done") is None


def test_stale_execution_that_fails_keeps_the_newer_execution_s_checkpoint(redis_client):
    save_as("t-stale", 3)
    recover("t-stale")
    save_as("t-stale", 4, attempt=1)
    with executing("t-stale") as t:
        on_task_failure(sender=t, task_id="t-stale", exception=ValueError())
    assert store().load("t-stale") == 4


def test_failure_reported_without_the_request_removes_a_checkpoint_only_the_first_run_wrote(redis_client):
    save_as("t-limit", 3)
    save_as("t-kept", 3)
    recover("t-kept")
    t = task()  # a hard time limit is reported from the worker's main process, with no request pushed
    on_task_failure(sender=t, task_id="t-limit", exception=TimeoutError())
    on_task_failure(sender=t, task_id="t-kept", exception=TimeoutError())
    assert store().load("t-limit") is None
    assert store().load("t-kept") == 3


def test_tasks_that_are_not_recoverable_are_refused_and_their_end_is_ignored(redis_client):
    from demoapp.tasks import scan

    scan.push_request(id="t-scan", called_directly=False)
    try:
        with pytest.raises(TypeError, match="is not marked @recoverable"):
            celery_orphans.checkpoint(scan)
    finally:
        scan.pop_request()
    redis_client.hset(Keys.current().checkpoint("t-scan"), "value", "1")
    on_task_success(sender=scan._get_current_object(), result="x")
    assert redis_client.exists(Keys.current().checkpoint("t-scan"))


def test_direct_call_keeps_its_checkpoint_in_memory_for_that_call_only(redis_client):
    checkpoint = celery_orphans.checkpoint(task())  # no request: the task is being called like a function
    assert checkpoint.value is None
    checkpoint.save({"last_id": 7})
    assert checkpoint.value == {"last_id": 7}
    assert redis_client.keys("*checkpoint*") == []


# -- with real workers --


def phases(task_id: str) -> list[str]:
    from demoapp.tasks import runs

    return [e.split(":")[0] for e in runs(task_id)]


def checkpoint_exists(redis_client: Any, task_id: str) -> bool:
    return bool(redis_client.exists(Keys.current().checkpoint(task_id)))


@pytest.mark.worker
def test_task_killed_at_step_100_of_200_resumes_from_its_checkpoint_and_leaves_none_behind(
    workers, redis_client
):
    from demoapp.tasks import count_steps, steps_executed

    worker = workers.start("steps@test")
    result = count_steps.delay(200, seconds=0.02)
    wait_for(lambda: steps_executed(result.id) >= 100, 30, "100 steps", interval=0.01)
    worker.kill()
    killed_after = steps_executed(result.id)
    saved = store().load(result.id)
    # The step counter is incremented before the checkpoint is saved: the kill may fall between.
    assert saved in (killed_after - 1, killed_after)
    assert killed_after < 150
    workers.start("steps@test")

    fresh = count_steps.delay(3)
    assert fresh.get(timeout=30) == 3
    assert phases(fresh.id) == ["start@0", "finish"]

    before_sweep = datetime.now(timezone.utc)
    sweep_until(result.id, Action.RECOVER)  # once the killed boot's lease has lapsed
    assert result.get(timeout=60) == 200

    assert phases(result.id) == ["start@0", f"start@{saved}", "finish"]
    recovered_run = 200 - saved
    assert recovered_run <= 101
    assert steps_executed(result.id) == killed_after + recovered_run
    audit = OrphanEvent.objects.get(task_id=result.id)
    assert audit.checkpoint_bytes == len(str(saved))
    assert audit.checkpoint_saved_at is not None and audit.checkpoint_saved_at <= before_sweep
    wait_for(lambda: not checkpoint_exists(redis_client, result.id), 10, "the checkpoint to be removed")


@pytest.mark.worker
def test_celery_retry_keeps_the_checkpoint_and_the_final_failure_removes_it(workers, redis_client):
    from demoapp.tasks import count_steps, steps_executed

    workers.start("retry@test")
    result = count_steps.delay(5, retry_at=3, fail_at=4)
    with pytest.raises(ValueError, match="failed at step 4"):
        result.get(timeout=30)

    assert phases(result.id) == ["start@0", "start@2"]
    assert steps_executed(result.id) == 3
    wait_for(lambda: not checkpoint_exists(redis_client, result.id), 10, "the checkpoint to be removed")


@pytest.mark.worker
def test_revoking_a_running_task_removes_its_checkpoint(workers, redis_client, celery_app):
    from demoapp.tasks import count_steps, steps_executed

    workers.start("revoke@test")
    result = count_steps.delay(200, seconds=0.05)
    wait_for(lambda: steps_executed(result.id) >= 3, 30, "a few steps")
    assert checkpoint_exists(redis_client, result.id)

    celery_app.control.revoke(result.id, terminate=True, signal=signal.SIGKILL)

    wait_for(lambda: not checkpoint_exists(redis_client, result.id), 20, "the checkpoint to be removed")
    assert TaskResult.objects.get(task_id=result.id).status == "REVOKED"


@pytest.mark.worker
def test_running_execution_that_lost_ownership_stops_at_its_next_save_and_writes_no_result(
    workers, redis_client
):
    from demoapp.tasks import count_steps, steps_executed

    worker = workers.start("owner@test")
    result = count_steps.delay(200, seconds=0.05)
    started_on(result.id, "owner@test")
    wait_for(lambda: steps_executed(result.id) >= 3, 30, "a few steps")
    entry = ledger().load([result.id])[result.id]

    # What a sweep does to a worker it wrongly took for dead: the fence now belongs to attempt 1.
    assert (
        ledger().claim(
            result.id,
            token=entry.token,
            attempts=0,
            retries=entry.delivery.retries,
            ttl=60,
            mode=ClaimMode.RECOVER,
        )
        == 1
    )

    wait_for(lambda: "may not save a checkpoint" in worker.log(), 20, "the stale execution to be fenced")
    wait_for(lambda: f"[{result.id}] ignored" in worker.log(), 20, "the stale execution to end")
    last = store().load(result.id)
    assert steps_executed(result.id) == last + 1  # the step it could not save
    assert last < 200
    assert TaskResult.objects.get(task_id=result.id).status == "STARTED"
    assert checkpoint_exists(redis_client, result.id)  # the newer execution will resume from it


def test_the_execution_is_a_fencing_token_that_orders_retries_first_then_recovery_attempts() -> None:
    from demoapp.tasks import summarize

    from celery_orphans import Execution, execution

    def of(retries: int, attempt: int | None) -> Execution:
        headers = {} if attempt is None else {"celery_orphans": {"attempt": attempt}}
        summarize.push_request(id="t", retries=retries, **headers)
        try:
            return execution(summarize)
        finally:
            summarize.pop_request()

    assert of(0, None) == (0, 0)
    assert of(0, None) < of(0, 1) < of(0, 2) < of(1, 0) < of(1, 1)
