"""The boot sweep and the one loop a worker's own sweeps share (sweep/boot.py, sweep/background.py)."""

from __future__ import annotations

import logging
from datetime import datetime, timezone

import pytest
import redis
from django_celery_results.models import TaskResult

from celery_orphans.exceptions import SweepLocked
from celery_orphans.models import OrphanEvent, Trigger
from celery_orphans.store import Keys
from celery_orphans.sweep import background, boot
from celery_orphans.sweep.values import Options
from tests import factories
from tests.helpers import MakeHeartbeat, lapse

pytestmark = pytest.mark.django_db(transaction=True)


def a_sweep() -> Options:
    return Options(trigger=Trigger.WATCH)


def never_called() -> Options:
    raise AssertionError("the options were read")


class Clock:
    """The loop's clock: sleeping advances it, and each wait is recorded (a mock of the clock)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.waited: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.waited.append(seconds)
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(background, "time", fake)
    return fake


def test_a_crashing_sweep_is_logged_with_its_traceback_and_the_thread_goes_on(monkeypatch, caplog):
    def crash(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a bug in the sweep")

    monkeypatch.setattr(background, "run", crash)

    with caplog.at_level(logging.ERROR, logger="celery_orphans"):
        report = background.sweep_giving_way("boot sweep of w@test", a_sweep, None)

    assert report is None
    [record] = caplog.records
    assert record.getMessage() == "celery-orphans: boot sweep of w@test failed"
    assert record.exc_info is not None and "a bug in the sweep" in str(record.exc_info[1])


def test_a_redis_fault_before_the_sweep_is_logged_too(caplog):
    def unreachable() -> Options:
        raise redis.ConnectionError("Connection refused")

    with caplog.at_level(logging.ERROR, logger="celery_orphans"):
        background.sweep_giving_way("boot sweep of w@test", unreachable, None)

    assert [r.getMessage() for r in caplog.records] == ["celery-orphans: boot sweep of w@test failed"]


def test_while_the_lock_is_held_it_tries_again_then_gives_way(monkeypatch, caplog, clock):
    tried: list[Options] = []

    def locked(options: Options, app: object) -> None:
        tried.append(options)
        raise SweepLocked("another reconcile sweep holds the lock")

    monkeypatch.setattr(background, "run", locked)

    with caplog.at_level(logging.INFO, logger="celery_orphans"):
        report = background.sweep_giving_way("the watch's sweep", a_sweep, None)

    assert report is None
    # Tried again every LOCK_RETRY_SECONDS, giving way once GIVE_WAY_AFTER_SECONDS had passed.
    assert set(clock.waited) == {background.LOCK_RETRY_SECONDS}
    assert clock.now == pytest.approx(background.GIVE_WAY_AFTER_SECONDS)
    assert len(tried) == len(clock.waited) + 1
    assert caplog.messages == ["celery-orphans: the watch's sweep gave way to other sweeps"]


def test_no_options_means_no_sweep(monkeypatch):
    monkeypatch.setattr(background, "run", never_called)

    assert background.sweep_giving_way("boot sweep of w@test", lambda: None, None) is None


def test_a_boot_sweep_recovers_what_the_previous_boot_of_its_name_left(
    redis_client, make_heartbeat: MakeHeartbeat
):
    old = make_heartbeat("reborn@test", boot="dead-boot")  # the boot factories.orphan's entries name
    old.renew()
    lapse(redis_client, old.node, old.boot)
    task_id = factories.orphan(worker="reborn@test")

    boot.sweep_at_boot(None, "reborn@test", "new-boot", datetime.now(timezone.utc))

    assert TaskResult.objects.get(task_id=task_id).status == "RETRY"
    assert OrphanEvent.objects.get(task_id=task_id).trigger == "worker_boot"


def test_a_boot_sweep_leaves_the_tasks_of_a_live_twin_to_the_regular_sweep(
    redis_client, make_heartbeat, caplog
):
    twin = make_heartbeat("twin@test", boot="dead-boot")  # the boot factories.orphan's entries name
    twin.start()  # alive: its heartbeat renews its lease
    task_id = factories.orphan(worker="twin@test")

    with caplog.at_level(logging.WARNING, logger="celery_orphans"):
        boot.sweep_at_boot(None, "twin@test", "new-boot", datetime.now(timezone.utc))

    assert "another live worker holds the name twin@test (boots dead-boot)" in caplog.text
    assert TaskResult.objects.get(task_id=task_id).status == "STARTED"
    assert not OrphanEvent.objects.exists()


def test_the_boot_sweep_leaves_an_earlier_boots_record_for_the_watchs_sweep(
    monkeypatch, redis_client, make_heartbeat: MakeHeartbeat
):
    # The watch's sweep, started at the same moment, judges the earlier boot's tasks within their grace
    # by that record (it says the boot is gone); pruning it first left them for a later sweep.
    old = make_heartbeat("reborn@test", boot="dead-boot")
    old.renew()
    lapse(redis_client, old.node, old.boot)
    monkeypatch.setattr(background, "run", lambda options, app: None)

    boot.sweep_at_boot(None, "reborn@test", "new-boot", datetime.now(timezone.utc))

    assert redis_client.hexists(Keys.current().boots("reborn@test"), "dead-boot")
