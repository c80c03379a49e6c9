"""The Django signals, sent after the change is committed, and receivers that raise."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from celery_orphans import orphan_detected, orphan_marked_terminal, orphan_recovered, sweep
from celery_orphans.models import OrphanEvent, Trigger
from tests import factories

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def received() -> Any:
    got: list[tuple[str, dict[str, Any]]] = []

    def receiver_for(name: str) -> Any:
        def receive(sender: Any, **kwargs: Any) -> None:
            assert sender is OrphanEvent
            kwargs.pop("signal")
            got.append((name, kwargs))

        return receive

    receivers = {
        orphan_detected: receiver_for("detected"),
        orphan_recovered: receiver_for("recovered"),
        orphan_marked_terminal: receiver_for("marked_terminal"),
    }
    for signal, receiver in receivers.items():
        signal.connect(receiver)
    yield got
    for signal, receiver in receivers.items():
        signal.disconnect(receiver)


def test_each_action_sends_detected_then_its_own_signal_with_the_documented_arguments(redis_client, received):
    recoverable = factories.orphan("demoapp.summarize")
    scan = factories.orphan("demoapp.scan", ("db",))

    sweep.run(sweep.Options(trigger=Trigger.COMMAND, grace_seconds=0))

    by_task = {(name, kwargs["task_id"]): kwargs for name, kwargs in received}
    assert set(by_task) == {
        ("detected", recoverable),
        ("recovered", recoverable),
        ("detected", scan),
        ("marked_terminal", scan),
    }
    assert by_task[("recovered", recoverable)] == {
        "task_id": recoverable,
        "task_name": "demoapp.summarize",
        "worker": factories.GHOST,
        "evidence": "lease_lapsed",
        "reason": "recoverable",
        "attempt": 1,
        "trigger": "command",
    }
    assert by_task[("marked_terminal", scan)]["reason"] == "not_recoverable"
    order = [name for name, kwargs in received if kwargs["task_id"] == scan]
    assert order == ["detected", "marked_terminal"]


def test_signals_wait_for_the_commit_and_are_not_sent_when_it_rolls_back(redis_client, received):
    from django.db import transaction

    factories.orphan("demoapp.summarize")

    def sweep_then_fail() -> None:
        with transaction.atomic():
            sweep.run(sweep.Options(trigger=Trigger.COMMAND, grace_seconds=0))
            assert received == []  # the sweep's own block committed into this outer one only
            raise RuntimeError("roll back")

    with pytest.raises(RuntimeError, match="roll back"):
        sweep_then_fail()
    assert received == []


def test_a_receiver_that_raises_is_logged_and_does_not_stop_the_sweep(redis_client, received, caplog):
    def broken(sender: Any, **kwargs: Any) -> None:
        raise ValueError("receiver bug")

    orphan_detected.connect(broken)
    try:
        ids = [factories.orphan("demoapp.summarize") for _ in range(2)]
        with caplog.at_level(logging.ERROR, logger="celery_orphans"):
            report = sweep.run(sweep.Options(trigger=Trigger.COMMAND, grace_seconds=0))
    finally:
        orphan_detected.disconnect(broken)

    assert all(o.done for o in report.outcomes)
    assert sorted(k["task_id"] for name, k in received if name == "recovered") == sorted(ids)
    ours = [r for r in caplog.records if r.name == "celery_orphans.recovery.audit"]
    assert len(ours) == 2
    assert all("receiver bug" in r.getMessage() for r in ours)
