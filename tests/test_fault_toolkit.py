"""The fault toolkit (tests/faults.py, tests/services.py) does what the never-twice tests rely on: the proxy's
modes against a plain Redis client, a Redis that refuses writes, a worker's stepped clocks, a main process
stopped alone, and the overlap checker's arithmetic."""

from __future__ import annotations

import re
import socket
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tests.faults import (
    SteppedClock,
    assert_no_overlap,
    effects,
    faketime_installed,
    main_frozen,
    overlap,
    pool_processes,
    quiet,
)
from tests.helpers import starts, wait_for
from tests.services import DOWN, UP, Mode, RedisServer, TcpProxy

TIMEOUT = 0.3  # the client's socket timeout: how long a fault that closes nothing takes to show


@pytest.fixture
def proxy(redis_client: Any) -> Any:
    found = TcpProxy(int(redis_client.connection_pool.connection_kwargs["port"]))
    yield found
    found.close()


def through(proxy: TcpProxy) -> redis.Redis[bytes]:
    """A client that gives up at once: no retry, a short timeout."""
    return redis.Redis.from_url(
        proxy.url(), socket_timeout=TIMEOUT, socket_connect_timeout=TIMEOUT, retry=Retry(NoBackoff(), 0)
    )


def test_the_proxy_passes_then_closes_every_connection_when_cut(proxy: TcpProxy) -> None:
    conn = through(proxy)
    assert conn.ping()

    proxy.cut()
    begun = time.monotonic()
    with pytest.raises(redis.ConnectionError):
        conn.ping()
    assert time.monotonic() - begun < TIMEOUT  # closed: no timeout to wait for

    proxy.restore()
    assert conn.ping()


def test_a_blackholed_proxy_keeps_connections_open_forwards_nothing_and_delivers_late_once_restored(
    proxy: TcpProxy, redis_client: Any
) -> None:
    conn = through(proxy)
    assert conn.ping()

    proxy.blackhole()
    with pytest.raises(redis.TimeoutError):
        conn.set("held", "1")
    fresh = through(proxy)  # a new connection is accepted, and answered by nobody
    with pytest.raises(redis.TimeoutError):
        fresh.ping()
    assert redis_client.get("held") is None

    proxy.restore()
    # What the partition held arrives once it heals, in order, as TCP would deliver it.
    wait_for(lambda: redis_client.get("held") == b"1", 2, "the held SET to arrive")


def test_a_one_way_proxy_carries_requests_up_but_not_their_replies(
    proxy: TcpProxy, redis_client: Any
) -> None:
    conn = through(proxy)
    conn.ping()

    proxy.one_way(UP)
    with pytest.raises(redis.TimeoutError):
        conn.set("up", "1")
    assert redis_client.get("up") == b"1"  # done, though the client never heard so

    proxy.one_way(DOWN)
    with pytest.raises(redis.TimeoutError):
        through(proxy).set("down", "1")
    assert redis_client.get("down") is None


def test_a_delaying_proxy_makes_each_round_trip_late(proxy: TcpProxy) -> None:
    conn = redis.Redis.from_url(proxy.url(), socket_timeout=5)
    conn.ping()

    proxy.delay(150)
    begun = time.monotonic()
    assert conn.ping()
    took = time.monotonic() - begun

    assert 0.3 <= took < 1.5  # the request and the reply, each 150 ms late


def test_a_proxy_told_which_connections_to_fault_lets_every_other_one_pass(redis_client: Any) -> None:
    proxy = TcpProxy(int(redis_client.connection_pool.connection_kwargs["port"]), only=b"chosen-one")
    try:
        chosen, other = through(proxy), through(proxy)
        chosen.client_setname("chosen-one")  # from now on the faults meet it
        assert other.ping()

        proxy.blackhole()
        with pytest.raises(redis.TimeoutError):
            chosen.ping()
        assert other.ping() and through(proxy).ping()  # new connections are accepted and answered
        proxy.cut()
        assert through(proxy).client_setname("a-stranger")
        with pytest.raises(redis.ConnectionError):
            through(proxy).client_setname("chosen-one")  # closed the moment it names itself
        assert proxy.faulted == 3  # the chosen connection twice, the one that named itself once
    finally:
        proxy.close()


def test_a_proxy_closing_the_servers_end_alone_leaves_the_clients_open_and_silent(
    proxy: TcpProxy, redis_client: Any
) -> None:
    client = socket.create_connection(("127.0.0.1", proxy.port), timeout=TIMEOUT)
    client.sendall(b"CLIENT SETNAME half-open\r\n")
    assert client.recv(64) == b"+OK\r\n"

    proxy.set(Mode.CLOSE_SERVER_END)

    def gone() -> bool:
        return all(c["name"] != "half-open" for c in redis_client.client_list())

    wait_for(gone, 2, "Redis to see its end closed")
    with pytest.raises(TimeoutError):
        client.recv(64)  # no reset, no end of stream: nothing at all
    client.close()


@pytest.mark.parametrize(
    ("how", "error"),
    [("oom", redis.exceptions.OutOfMemoryError), ("readonly", redis.exceptions.ReadOnlyError)],
)
def test_a_redis_that_refuses_writes_answers_reads_and_takes_writes_again_once_restored(
    tmp_path: Path, how: str, error: type[redis.ResponseError]
) -> None:
    server = RedisServer(tmp_path / "refusing").start()
    try:
        conn = server.client()
        conn.set("kept", "1")

        server.refuse_writes(how)
        with pytest.raises(error):
            conn.set("refused", "1")
        with pytest.raises(error):
            conn.eval("return redis.call('SET', KEYS[1], '1')", 1, "scripted")
        assert conn.get("kept") == b"1"

        server.accept_writes()
        assert conn.set("refused", "1")
        assert conn.get("refused") == b"1"
    finally:
        server.stop()


def test_the_toolkit_can_step_a_worker_clock() -> None:
    # tests/setup-env.sh installs Debian's faketime package; without it no clock test can run.
    assert faketime_installed()


@pytest.mark.worker
def test_a_worker_sees_its_wall_clock_monotonic_clock_and_boot_time_stepped(
    workers: Any, tmp_path: Path
) -> None:
    from demoapp.tasks import runs, stored, tick

    clock = SteppedClock(tmp_path / "clock")
    worker = workers.start("stepped@test", env=clock.env())
    clock.step_wall(86400)  # a day ahead, while it runs
    result = tick.delay(60, every=0.2)
    wait_for(lambda: effects(result.id), 20, "the task to begin")
    [first] = overlap(result.id).executions

    # The task's own records and the worker's log lines both carry the stepped time.
    started_at = float(runs(result.id)[0].split(":")[2])
    assert abs(started_at - time.time() - 86400) < 30
    tomorrow = datetime.fromtimestamp(time.time() + 86400).strftime("%Y-%m-%d")
    wait_for(
        lambda: re.search(rf"\[{tomorrow} [^]]*\] Task demoapp.tick\[{result.id}\]", worker.log()),
        10,
        "a log line",
    )

    # A minute forward on CLOCK_BOOTTIME, which the worker judges its lease by: it gives its boot up though
    # every renewal succeeded, and the execution is refused its result. Then a minute forward on
    # time.monotonic(), which the body counts its 60 s on: it ends at its next look. The worker, under a new
    # boot, may already run the task again from the ledger (a fresh 60 s): only the first execution must stop.
    clock.step_boottime(60)
    clock.step_monotonic(60)
    wait_for(lambda: "(its lease was not renewed in time)" in worker.log(), 10, "the worker to give up")
    quiet(result.id, seconds=1.0, timeout=30, execution=first)
    assert stored(result.id) == 0


@pytest.mark.worker
def test_a_worker_main_process_frozen_alone_leaves_its_pool_running(workers: Any) -> None:
    from demoapp.tasks import tick

    worker = workers.start("main-frozen@test")
    result = tick.delay(3, every=0.2)
    wait_for(lambda: starts(result.id), 20, "the task to begin")
    [pool] = pool_processes(worker)

    with main_frozen(worker):
        wait_for(lambda: state(worker.pid) == "T", 2, "the main process to stop", interval=0.01)
        assert state(pool) != "T"
        before = len(effects(result.id))
        wait_for(lambda: len(effects(result.id)) >= before + 3, 5, "the pool to act on its own")

    assert result.get(timeout=20) == len(effects(result.id))


def state(pid: int) -> str:
    """The process's state letter in /proc (T: stopped)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


# --- the overlap checker -----------------------------------------------------------------------------


def record(redis_client: Any, task_id: str, execution: str, at: float) -> None:
    redis_client.rpush(f"demo:effects:{task_id}", f"{execution}:1:0:{at}:{at}")


def test_the_overlap_checker_counts_a_stale_execution_acting_after_a_later_one_started(
    redis_client: Any,
) -> None:
    for at in (0.0, 0.5, 1.0, 1.5, 2.0, 2.5):
        record(redis_client, "t", "stale", 100 + at)
    for at in (1.2, 1.7):
        record(redis_client, "t", "recovered", 100 + at)

    found = overlap("t")

    assert found.executions == ["stale", "recovered"]
    assert [e.at for e in found.stale] == [101.5, 102.0, 102.5]
    assert (found.count, round(found.window, 2)) == (3, 1.3)
    with pytest.raises(AssertionError, match="3 side effects of a stale execution"):
        assert_no_overlap("t")
    assert_no_overlap("t", tolerance=1.5)


def test_the_overlap_checker_finds_none_between_executions_that_follow_each_other(
    redis_client: Any,
) -> None:
    for execution, at in (("a", 0.0), ("a", 0.5), ("b", 1.0), ("b", 1.5), ("c", 2.0)):
        record(redis_client, "t", execution, at)

    found = assert_no_overlap("t")

    assert (found.executions, found.count, found.window) == (["a", "b", "c"], 0, 0.0)
