"""Prometheus metrics, scraped as text and parsed."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from celery_orphans import sweep
from celery_orphans.models import Trigger
from celery_orphans.worker import heartbeat
from tests import factories
from tests.helpers import lapse

pytestmark = pytest.mark.django_db(transaction=True)


def scrape() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    samples = {}
    for family in text_string_to_metric_families(generate_latest(REGISTRY).decode()):
        for s in family.samples:
            if s.name.startswith("celery_orphans_"):
                samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def test_recoveries_terminal_marks_sweeps_and_time_since_the_last_heartbeat_are_exported(redis_client):
    before = scrape()
    beat = heartbeat.Heartbeat(factories.GHOST, boot="dead-boot")
    beat.renew()  # the dead worker's last beat
    lapse(redis_client, beat.node, beat.boot)  # ...and its lease has lapsed
    factories.orphan("demoapp.summarize")
    factories.orphan("demoapp.scan", ("db",))

    sweep.run(sweep.Options(trigger=Trigger.COMMAND, grace_seconds=0))

    after = scrape()

    def grew(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert grew("celery_orphans_recovered_total", task_name="demoapp.summarize", evidence="lease_lapsed") == 1
    assert (
        grew("celery_orphans_marked_terminal_total", task_name="demoapp.scan", reason="not_recoverable") == 1
    )
    assert grew("celery_orphans_heartbeat_to_recovery_seconds_count") == 1
    assert grew("celery_orphans_sweep_duration_seconds_count") == 1
    assert ("celery_orphans_leases", ()) in after
