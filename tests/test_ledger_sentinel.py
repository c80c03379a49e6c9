"""The ledger's Redis reached through Redis Sentinel (``sentinel://``): its master fails over to a replica
while a task runs, and the task of a worker killed after that is recovered once, through the new master.
The broker and the test project's records of runs stay on the run's plain Redis."""

from __future__ import annotations

from typing import Any

import pytest

from celery_orphans.ledger import Ledger
from celery_orphans.models import OrphanEvent
from celery_orphans.store import Keys, client
from tests.helpers import starts, summarize_on_a_doomed_worker, wait_for
from tests.services import SentinelSet

pytestmark = pytest.mark.worker


def test_a_ledger_behind_sentinel_survives_a_failover_and_recovers_a_killed_workers_task(
    workers: Any, sentinel_servers: SentinelSet, settings: Any, own_clients: None
) -> None:
    env = {
        "CELERY_ORPHANS_REDIS_URL": sentinel_servers.sentinel.url(),
        "CELERY_ORPHANS_REDIS_SENTINEL_MASTER": "orphans",
        # Longer than the failover (about two seconds here), which must not cost any worker its lease.
        "CELERY_ORPHANS_LEASE_SECONDS": "8",
        "CELERY_ORPHANS_HEARTBEAT_SECONDS": "0.5",
    }
    settings.CELERY_ORPHANS_REDIS_URL = sentinel_servers.sentinel.url()
    settings.CELERY_ORPHANS_REDIS_SENTINEL_MASTER = "orphans"
    doomed, result = summarize_on_a_doomed_worker(workers, "sentinel", seconds=6, env=env)
    # The entry reached the replica (replication is asynchronous: what did not is lost with the master).
    entry = Keys.current().entry(result.id)
    wait_for(lambda: sentinel_servers.replica.client().exists(entry), 10, "the entry on the replica")

    sentinel_servers.master.stop()  # the master's machine is lost
    wait_for(
        lambda: sentinel_servers.sentinel.master_port() == sentinel_servers.replica.port,
        20,
        "the sentinel to promote the replica",
    )
    assert Ledger(client(), Keys.current()).count() == 1  # this process's client found the new master

    doomed.kill()

    event = wait_for(
        lambda: OrphanEvent.objects.filter(task_id=result.id).first(), 30, f"{result.id} recovered"
    )
    assert (event.action, event.evidence) == ("recovered", "process_exited")
    assert result.get(timeout=30) == 5
    assert starts(result.id) == 2
    # Nothing else was judged orphaned meanwhile: the failover took no lease away.
    assert OrphanEvent.objects.count() == 1
    workers.close()  # before their ledger goes
