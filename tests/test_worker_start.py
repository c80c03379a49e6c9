"""A worker's start slower than its lease's validity: the tasks RabbitMQ hands it while it subscribes,
before it says it is ready, are admitted under a lease the heartbeat already keeps (receivers.PoolStarted).

The consumer's start is slowed by the test project (``TESTPROJECT_SLOW_CONSUMER_START``), as a slow
broker link or a long mingle slows it: the time between the pool's start and the subscription.
"""

from __future__ import annotations

import re
import time
from typing import Any

import pytest

from celery_orphans.store import Keys, client
from tests.faults import report
from tests.helpers import wait_for

pytestmark = pytest.mark.worker

SLOW = 3.0  # seconds: past the suite's validity (a 2 s lease less its 0.7 s margin)
QUEUES = ("celery", "rmq-solo")  # several queues: RabbitMQ delivers from the first while it subscribes


def test_a_worker_whose_start_outlasts_its_validity_runs_its_first_tasks_under_its_first_lease(
    workers: Any, amqp_broker: str
) -> None:
    from demoapp.tasks import runs, summarize

    results = [summarize.apply_async(([i],), {"seconds": 0.5}, queue=q) for q in QUEUES for i in range(2)]
    node = "slow-start@test"
    worker = workers.start(
        node,
        env={"CELERY_BROKER_URL": amqp_broker, "TESTPROJECT_SLOW_CONSUMER_START": str(SLOW)},
        queues=QUEUES,
        concurrency=2,
        ready_timeout=30 + SLOW,
    )
    started = time.monotonic() - worker.started_at
    assert started >= SLOW, "the consumer's start was not slowed"
    wait_for(
        lambda: all(r.ready() for r in results) or "gives up its boot" in worker.log(),
        30,
        "the first tasks to finish",
        interval=0.2,
    )

    log = worker.log()
    assert "gives up its boot" not in log, log[-3000:]
    assert sorted(r.get(timeout=10) for r in results) == [0, 0, 1, 1]
    for r in results:
        assert [e.split(":")[0] for e in runs(r.id)] == ["start", "finish"], r.id
    [boot] = re.findall(rf"lease of {re.escape(node)} \(boot (\w+)\) taken", log)
    assert client().exists(Keys.current().lease(node, boot)), "the first boot's lease lapsed"
    report("slow consumer start", start_seconds=started, validity_seconds=1.3, boots=1, forfeit=0)
