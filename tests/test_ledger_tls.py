"""The ledger's Redis reached over TLS (``rediss://``, the certificate verified): a killed worker's task
is recovered. The broker stays on the run's plain Redis."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from celery_orphans.ledger import Ledger
from celery_orphans.models import OrphanEvent
from celery_orphans.store import Keys, client
from tests.helpers import summarize_on_a_doomed_worker, wait_for
from tests.services import RedisServer

pytestmark = pytest.mark.worker


def test_a_ledger_reached_over_tls_recovers_a_killed_workers_task(
    workers: Any, tmp_path: Path, settings: Any
) -> None:
    server = RedisServer(tmp_path / "tls", tls=True).start()
    try:
        env = {"CELERY_BROKER_URL": settings.REDIS_URL, "REDIS_URL": server.url()}
        # The ledger, and the records the test project's tasks keep of their runs.
        settings.CELERY_ORPHANS_REDIS_URL = settings.REDIS_URL = server.url()
        doomed, result = summarize_on_a_doomed_worker(workers, "tls", seconds=3, env=env)
        assert client().connection_pool.connection_kwargs["ssl_cert_reqs"] == "required"
        wait_for(lambda: Ledger(client(), Keys.current()).count() == 1, 10, "the entry in the TLS ledger")

        doomed.kill()

        event = wait_for(
            lambda: OrphanEvent.objects.filter(task_id=result.id).first(), 30, f"{result.id} recovered"
        )
        assert (event.action, event.evidence) == ("recovered", "process_exited")
        assert result.get(timeout=30) == 5
    finally:
        workers.close()  # before their ledger goes
        server.stop()
