from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest

from tests.workers import WorkerPool, wait_for


def pytest_configure(config: pytest.Config) -> None:
    # The suite owns one test database and one Redis database: two runs on one machine take turns.
    path = os.path.join(tempfile.gettempdir(), "celery-orphans-tests.lock")
    handle = open(path, "w")  # noqa: SIM115 - held open for the whole run
    fcntl.flock(handle, fcntl.LOCK_EX)
    config.stash[_LOCK] = handle


_LOCK = pytest.StashKey[object]()


@pytest.fixture
def redis_client() -> Iterator[object]:
    import redis
    from django.conf import settings

    client = redis.Redis.from_url(settings.REDIS_URL)
    client.flushdb()
    yield client
    client.close()


@pytest.fixture
def celery_app() -> object:
    from testproject.celery import app

    return app


def _database_url() -> str:
    from django.db import connection

    s = connection.settings_dict
    if s["ENGINE"].endswith("sqlite3"):
        return f"sqlite:///{s['NAME']}"
    auth = quote(s["USER"] or "")
    if s["PASSWORD"]:
        auth += ":" + quote(s["PASSWORD"])
    return f"postgres://{auth}@{s['HOST'] or '127.0.0.1'}:{s['PORT'] or 5432}/{s['NAME']}"


@pytest.fixture
def workers(
    tmp_path: Path, redis_client: object, transactional_db: None, request: pytest.FixtureRequest
) -> Iterator[WorkerPool]:
    """Start real workers with ``workers.start(name, pool=..., concurrency=..., queues=...)``."""
    env = {**os.environ, "DATABASE_URL": _database_url(), "PYTHONPATH": str(Path(__file__).parent.parent)}
    pool = WorkerPool(tmp_path, env)
    yield pool
    pool.close()
    _wait_for_worker_sessions_to_end()
    if request.node.rep_call.failed if hasattr(request.node, "rep_call") else False:
        for worker in pool:
            print(f"--- log of {worker.name} ---\n{worker.log()[-6000:]}")


def _wait_for_worker_sessions_to_end() -> None:
    """PostgreSQL notices a killed worker's connections a moment later; the test database must be free."""
    from django.db import connection

    if connection.vendor != "postgresql":
        return
    with connection.cursor() as cursor:
        wait_for(
            lambda: not _other_sessions(cursor), 15, "killed workers' database sessions to end", interval=0.1
        )


def _other_sessions(cursor: object) -> int:
    cursor.execute(  # type: ignore[attr-defined]
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
    )
    return int(cursor.fetchone()[0])  # type: ignore[attr-defined]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> object:
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report
