"""What a worker counts a broker's redelivery against (the counting itself: test_ledger, test_rabbitmq)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery

from celery_orphans.worker.redelivery import first_hand, limits, marks_redeliveries, single_flight


class Held:
    """A request as the worker's state keeps it: an id and its task."""

    def __init__(self, task: Any, task_id: str = "t-1") -> None:
        self.task = task
        self.id = task_id


@pytest.fixture
def poison() -> Any:
    from demoapp.tasks import poison

    return poison  # @recoverable(max_attempts=2)


def test_a_redelivery_counts_against_the_tasks_own_cap_then_the_setting(settings: Any, poison: Any) -> None:
    from demoapp.tasks import summarize

    settings.CELERY_ORPHANS_MAX_ATTEMPTS = 5
    settings.CELERY_ORPHANS_ATTEMPTS_WINDOW_SECONDS = 7200

    assert limits(Held(poison)) == (2, 7200)
    assert limits(Held(summarize)) == (5, 7200)


@pytest.mark.parametrize("setting", ["CELERY_ORPHANS_SHADOW_MODE", "CELERY_ORPHANS_ENABLED"])
def test_nothing_is_counted_in_shadow_mode_or_when_disabled(settings: Any, poison: Any, setting: str) -> None:
    setattr(settings, setting, setting.endswith("SHADOW_MODE"))

    assert limits(Held(poison)) == (0, 0)


@pytest.mark.parametrize("setting", ["CELERY_ORPHANS_SHADOW_MODE", "CELERY_ORPHANS_ENABLED"])
def test_duplicates_of_live_executions_are_dropped_only_when_recovery_is_on(
    settings: Any, setting: str
) -> None:
    assert single_flight() is True

    setattr(settings, setting, setting.endswith("SHADOW_MODE"))

    assert single_flight() is False


class Delivered(Held):
    """A request as the broker delivered it, for the first time or again."""

    def __init__(
        self, task: Any, *, redelivered: bool, eta: str | None = None, headers: dict[str, Any] | None = None
    ) -> None:
        super().__init__(task)
        self.delivery_info = {"exchange": "", "routing_key": "celery", "redelivered": redelivered}
        self.eta = eta
        self.message = SimpleNamespace(headers=headers or {})


@pytest.mark.parametrize(
    ("url", "marks"),
    [
        ("redis://127.0.0.1:6379/9", True),
        ("rediss://127.0.0.1:6380/0?ssl_cert_reqs=required", True),
        ("amqp://guest:guest@127.0.0.1:5672//", True),
        ("pyamqp://guest:guest@127.0.0.1:5672//", True),
        ("memory://", False),
        ("filesystem://", False),
    ],
)
def test_only_a_transport_that_flags_what_it_delivers_again_is_trusted_to(url: str, marks: bool) -> None:
    assert marks_redeliveries(Celery(broker=url, set_as_current=False)) is marks


def test_a_first_delivery_skips_the_fence_check_and_a_redelivery_does_not(poison: Any) -> None:
    assert poison.app.conf.broker_url.startswith("redis://")

    assert first_hand(Delivered(poison, redelivered=False)) is True
    assert first_hand(Delivered(poison, redelivered=True)) is False


def test_a_delivery_with_an_eta_is_always_checked(poison: Any) -> None:
    # A transport restores an ETA message a worker holds past its visibility timeout: the first worker's
    # copy, never delivered again, comes due at the same moment as the second worker's.
    assert first_hand(Delivered(poison, redelivered=False, eta="2026-11-25T12:00:00+00:00")) is False


def test_a_copy_a_recovery_sent_is_always_checked(poison: Any) -> None:
    # A sweep that crashed after its publish, or a publish retried after the broker took it, sends the
    # same copy twice: neither is marked as delivered again, and only the admit can drop the second.
    recovered = {"id": "t-1", "celery_orphans": {"attempt": 1}}

    assert first_hand(Delivered(poison, redelivered=False, headers=recovered)) is False
    assert first_hand(Delivered(poison, redelivered=False, headers={"id": "t-1"})) is True
