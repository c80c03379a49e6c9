from __future__ import annotations

import fcntl
import os
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hypothesis
import pytest
import redis
from celery import Celery
from kombu import Connection, pools
from pytest_django import Settings

from celery_orphans import store
from celery_orphans.ledger import Ledger
from celery_orphans.store import Keys, client
from celery_orphans.worker import forfeit, lifecycle
from celery_orphans.worker.heartbeat import Heartbeat
from tests.helpers import MakeHeartbeat, database_url, wait_for
from tests.services import TEST_DATABASE_NAME, MachineRedisGuard, RedisServer, SentinelSet, Vhost, purge
from tests.workers import WorkerPool

# Property tests draw examples derived from each test rather than from a fresh seed, so a run is red or
# green for the code alone; HYPOTHESIS_PROFILE=explore draws new examples on every run.
hypothesis.settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
hypothesis.settings.register_profile("explore", database=None, print_blob=True)
hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_configure(config: pytest.Config) -> None:
    # The suite's database and RabbitMQ vhost have fixed names (tests/services.py): two runs on one
    # machine take turns.
    path = os.path.join(tempfile.gettempdir(), f"{TEST_DATABASE_NAME}.lock")
    handle = open(path, "w")  # noqa: SIM115 - held open for the whole run
    fcntl.flock(handle, fcntl.LOCK_EX)
    config.stash[_LOCK] = handle
    if os.environ.get("TEST_CELERY_ORPHANS_INSTALLED"):
        import celery_orphans

        # tests/installed.py: the package must come from site-packages, not from a checkout.
        assert "site-packages" in Path(celery_orphans.__file__).parts, celery_orphans.__file__


_LOCK = pytest.StashKey[object]()
_GUARD = pytest.StashKey[MachineRedisGuard]()


def pytest_sessionstart(session: pytest.Session) -> None:
    guard = MachineRedisGuard(skip=os.environ.get("TEST_REDIS_URL"))
    if guard.plant():
        session.config.stash[_GUARD] = guard


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run if it touched the machine's own Redis (``MachineRedisGuard``)."""
    guard = session.config.stash.get(_GUARD, None)
    findings = guard.findings() if guard is not None else []
    if findings:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.ensure_newline()
            reporter.section("the run touched the machine's Redis at 127.0.0.1:6379", red=True)
            for finding in findings:
                reporter.write_line(finding, red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# The tests marked ``faults`` show faults the product does not withstand yet: they run only when asked,
# with ``-m faults`` (or a marker expression naming them) or CELERY_ORPHANS_FAULTS=1.
FAULTS_ENV = "CELERY_ORPHANS_FAULTS"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--shard",
        default=None,
        metavar="K/N",
        help="run the K-th of N shares of the selected tests (every N-th, from the K-th): N runs with "
        "K = 1..N, each with a TEST_RUN_NAME of its own, run the suite once between them (.ci/run)",
    )


@pytest.hookimpl(trylast=True)  # after pytest-django has ordered the tests
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _no_faults(config):
        _deselect(config, items, [item for item in items if item.get_closest_marker("faults")])
    shard = config.getoption("shard")
    if shard is not None:
        k, n = _shard(shard)
        _deselect(config, items, [item for i, item in enumerate(items) if i % n != k - 1])


def _no_faults(config: pytest.Config) -> bool:
    return "faults" not in (config.getoption("markexpr") or "") and os.environ.get(FAULTS_ENV) != "1"


def _shard(text: str) -> tuple[int, int]:
    try:
        k, n = (int(part) for part in text.split("/"))
    except ValueError:
        raise pytest.UsageError(f"--shard takes K/N, such as 1/2: got {text!r}") from None
    if not 1 <= k <= n:
        raise pytest.UsageError(f"--shard K/N needs 1 <= K <= N: got {text!r}")
    return k, n


def _deselect(config: pytest.Config, items: list[pytest.Item], dropped: list[pytest.Item]) -> None:
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        gone = set(dropped)
        items[:] = [item for item in items if item not in gone]


@pytest.fixture
def ledger_redis(tmp_path: Path, settings: Settings) -> Iterator[RedisServer]:
    """The ledger and leases in a persistent Redis of the test's own; results and runs stay in the suite's.
    A worker uses it with ``env=ledger_env(ledger_redis)`` (tests/helpers.py)."""
    server = RedisServer(tmp_path / "ledger", persistent=True).start()
    settings.CELERY_ORPHANS_REDIS_URL = server.url()
    settings.CELERY_ORPHANS_INSPECT_TIMEOUT_SECONDS = 0.05  # the orphans' node never answers
    yield server
    server.stop()


@pytest.fixture
def redis_client() -> Iterator[object]:
    """A client of the run's own Redis (tests/services.py), emptied for the test."""
    import redis
    from django.conf import settings

    client = redis.Redis.from_url(settings.REDIS_URL)
    client.flushdb()
    yield client
    client.close()


@pytest.fixture
def ledger(redis_client: object) -> Ledger:
    """The ledger under the configured prefix, on the run's own Redis, emptied for the test."""
    return Ledger(client(), Keys.current())


@pytest.fixture
def sentinel_servers(tmp_path: Path) -> Iterator[SentinelSet]:
    """A Redis master, its replica and a sentinel watching it as ``orphans`` (``SentinelSet``)."""
    servers = SentinelSet.start(tmp_path)
    yield servers
    servers.stop()


@pytest.fixture(scope="session")
def amqp_url() -> Iterator[str]:
    """The run's RabbitMQ vhost (see tests/services.py), made at the first test that needs it."""
    given = os.environ.get("TEST_AMQP_URL")
    if given:
        yield given
        return
    vhost = Vhost().create()
    yield vhost.url()
    vhost.delete()


RABBITMQ_QUEUES = ("celery", "rmq-solo")


def _reset_pools(app: Any) -> None:
    """Close every pooled broker connection and forget the pools, so the next use opens a new one.

    The app caches its connection pool (``app._pool``) and producer pool (``app.amqp._producer_pool``);
    both come from kombu's process-wide registries, keyed by connection URL, where a closed pool would
    be handed out again for the same URL: those are emptied too.
    """
    app.pool.force_close_all()
    pools.reset()
    app._pool = None
    app.amqp._producer_pool = None


@pytest.fixture
def amqp_broker(celery_app: Any, amqp_url: str) -> Iterator[str]:
    """Point this process's Celery app at the run's RabbitMQ vhost for the test; put the previous broker
    back after."""
    with Connection(amqp_url, connect_timeout=5) as conn:
        conn.ensure_connection(max_retries=1)  # RabbitMQ must be up: start it with rabbitmq-server -detached
    previous_env = os.environ.get("CELERY_BROKER_URL")
    previous_conf = celery_app.conf.broker_url
    _reset_pools(celery_app)
    # Celery's conf reads the environment variable first, then the setting.
    os.environ["CELERY_BROKER_URL"] = amqp_url
    celery_app.conf.broker_url = amqp_url
    purge(amqp_url, *RABBITMQ_QUEUES)
    try:
        assert celery_app.connection_for_write().transport.driver_type == "amqp"
        yield amqp_url
    finally:
        _reset_pools(celery_app)
        celery_app.conf.broker_url = previous_conf
        if previous_env is None:
            os.environ.pop("CELERY_BROKER_URL", None)
        else:
            os.environ["CELERY_BROKER_URL"] = previous_env
        purge(amqp_url, *RABBITMQ_QUEUES)


@pytest.fixture
def celery_app() -> object:
    from testproject.celery import app

    return app


@pytest.fixture
def fresh_app() -> Celery:
    """A Celery app of its own, without Django, so its defaults can differ from the test project's."""
    return Celery("t", set_as_current=False, fixups=[])


@pytest.fixture
def workers(
    tmp_path: Path, redis_client: object, transactional_db: None, request: pytest.FixtureRequest
) -> Iterator[WorkerPool]:
    """Start real workers with ``workers.start(name, pool=..., concurrency=..., queues=...)``."""
    env = {**os.environ, "DATABASE_URL": database_url(), "PYTHONPATH": str(Path(__file__).parent.parent)}
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


# --- worker leases ---------------------------------------------------------------------------------


@pytest.fixture
def node() -> str:
    return f"celery@test-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def make_heartbeat(redis_client: redis.Redis) -> Iterator[MakeHeartbeat]:
    """Make heartbeats (read the settings in force at the call); every one is stopped afterwards."""
    made: list[Heartbeat] = []

    def make(node: str, *, boot: str | None = None, on_renewed: Any = None) -> Heartbeat:
        made.append(Heartbeat(node, boot, on_renewed=on_renewed))
        return made[-1]

    yield make
    for heartbeat in made:
        heartbeat.stop()
    lifecycle.stop()


@pytest.fixture
def short_lease(settings: Settings) -> Settings:
    """Leases that lapse in 0.5 s and are renewed every 0.1 s, so expiry is seen within a second."""
    settings.CELERY_ORPHANS_LEASE_SECONDS = 0.5
    settings.CELERY_ORPHANS_HEARTBEAT_SECONDS = 0.1
    return settings


@pytest.fixture
def shared_validity() -> Iterator[None]:
    """Put the worker's validity shared with its pool (``forfeit._validity``) back as it was: it is this
    process's own."""
    before = forfeit._validity[:]
    yield
    forfeit._validity[:] = before


@pytest.fixture
def own_clients(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A client cache of this test's own, so a client made for a changed URL does not outlive it."""
    clients: dict[str, redis.Redis] = {}
    monkeypatch.setattr(store, "_clients", clients)
    yield
    for found in clients.values():
        found.close()
