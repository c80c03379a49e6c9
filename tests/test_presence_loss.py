"""A presence connection's loss pausing a prefork worker's executions (``PRESENCE_LOSS_PAUSES``, on by
default), with real workers: a live worker whose presence connection ended stops its executions before
another worker may judge it gone by that loss, unless it makes the connection again first; they go on
once a renewal answers that its lease holds (a restart of the ledger's Redis gives nothing up, however
long within the lease's margin), and are killed once its lease is given up (judged, they run again once
elsewhere). Renewals 2 s apart and a 10 s lease, the defaults: another worker judges no sooner than 2.5 s
after it saw the loss."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from celery_orphans.models import OrphanEvent
from celery_orphans.worker.presence import CLIENT_NAME
from tests.faults import longest_pause, overlap, quiet, report, tick_beside_a_watcher
from tests.helpers import finishes, ledger_env, starts, sweep_now, wait_for
from tests.services import TcpProxy

pytestmark = pytest.mark.worker

# The default, said aloud: the watcher has it too, which changes nothing for it.
FORFEITS = {"CELERY_ORPHANS_PRESENCE_LOSS_PAUSES": "true"}
PAUSED = "pauses its execution: the presence connection of its worker was lost"


def wait_for_a_recovered_execution(task_id: str, *, sweep: bool = True) -> None:
    """Until a second execution of ``task_id`` has acted (with ``sweep``, sweeping meanwhile): a copy that
    starts on the cut-off worker may be ended there before it acts, and is not the one looked for."""
    wait_for(
        lambda: (not sweep or sweep_now() is not None) and len(overlap(task_id).executions) >= 2,
        60,
        "a recovered execution that acts",
    )


# Before, the boot was judged by its lost presence only a heartbeat before its lease's end, 7.4 s after
# its last renewal; now once another worker has seen the loss for its wait, and its executions are
# stopped by then.
def test_a_live_worker_whose_ledger_link_is_reset_then_cut_off_stops_its_task_before_it_is_judged(
    workers: Any, redis_client: Any
) -> None:
    link = TcpProxy(int(redis_client.connection_pool.connection_kwargs["port"]))
    try:
        env = {"CELERY_ORPHANS_REDIS_URL": link.url()}
        live, result = tick_beside_a_watcher(workers, "reset-then-cut", 30, env=env, shared=FORFEITS)
        # A middlebox resets every connection, then drops everything: the worker hears the reset, and can
        # neither connect again nor renew.
        link.cut()
        cut = time.time()
        time.sleep(0.2)
        link.blackhole()
        wait_for(lambda: OrphanEvent.objects.filter(task_id=result.id).exists(), 20, "the recovery")
        recovered = time.time()
        try:
            wait_for_a_recovered_execution(result.id, sweep=False)
        except Exception:
            print(live.log()[-6000:])
            raise
        found = quiet(result.id, seconds=3, timeout=60)
    finally:
        link.close()

    event = OrphanEvent.objects.get(task_id=result.id)
    report(
        "ledger link reset, then cut off",
        recovered_after=recovered - cut,
        evidence=event.evidence,
        executions=len(found.executions),
        stale_effects=found.count,
        overlap_seconds=found.window,
    )
    assert PAUSED in live.log()
    wait_for(lambda: "gives up its boot" in live.log(), 20, "the paused execution given up with its lease")
    assert event.evidence == "presence_lost"
    assert len(found.executions) == 2 and not found.stale, str(found)


# Redis restarted within the 1.5 s: the connection is made again to a new server in time.
def test_a_short_restart_of_the_ledger_gives_no_live_worker_up(workers: Any, ledger_redis: Any) -> None:
    shared = ledger_env(ledger_redis)
    _, result = tick_beside_a_watcher(workers, "restart", 12, shared={**FORFEITS, **shared})
    ledger_redis.stop()
    time.sleep(0.5)
    ledger_redis.start()

    assert result.get(timeout=60) is not None
    logs = "".join(w.log() for w in workers)
    assert "gives up its boot" not in logs
    assert not OrphanEvent.objects.filter(task_id=result.id).exists()
    assert (starts(result.id), finishes(result.id)) == (1, 1)


# Redis down 4 s, longer than the 1.5 s: refused connections say nothing of who else reaches the server
# (next test), so the worker pauses its execution; the first renewal after the restart finds its lease
# (the server keeps its data), and the execution goes on. Before, it was given up and ran again once.
def test_a_longer_restart_of_the_ledger_pauses_the_task_and_gives_nothing_up(
    workers: Any, ledger_redis: Any
) -> None:
    shared = ledger_env(ledger_redis)
    live, result = tick_beside_a_watcher(workers, "long-restart", 12, shared={**FORFEITS, **shared})
    ledger_redis.stop()
    time.sleep(4)
    ledger_redis.start()

    assert result.get(timeout=60) is not None
    paused = longest_pause(result.id)
    logs = "".join(w.log() for w in workers)
    report("ledger down 4 s", longest_pause=paused, executions=len(overlap(result.id).executions))
    assert PAUSED in live.log() and "continues the paused pool process" in live.log()
    assert "gives up its boot" not in logs
    assert not OrphanEvent.objects.filter(task_id=result.id).exists()
    assert (starts(result.id), finishes(result.id)) == (1, 1)
    assert paused > 1.5  # it did pause: its side effects stopped while Redis was down


# Its way to a live ledger refuses every connection (a local proxy or sidecar restarting, a firewall that
# rejects), while other workers reach Redis: before, the worker took the refusals for a server down and
# held its give-up off; it was recovered 4.4 s after, while its stale execution acted 2.4 to 2.6 s more.
def test_a_worker_whose_way_to_a_live_ledger_refuses_stops_its_task_before_it_is_judged(
    workers: Any, redis_client: Any
) -> None:
    link = TcpProxy(int(redis_client.connection_pool.connection_kwargs["port"]))
    env = {"CELERY_ORPHANS_REDIS_URL": link.url()}
    live, result = tick_beside_a_watcher(workers, "refused", 30, env=env, shared=FORFEITS)
    link.close()  # every connection reset, and nothing listens there any more: each new one refused
    closed = time.time()
    wait_for_a_recovered_execution(result.id)
    found = quiet(result.id, seconds=3, timeout=60)

    report(
        "the worker's way to a live ledger refuses",
        recovered_after=found.started[found.executions[1]] - closed,
        stale_effects=found.count,
        overlap_seconds=found.window,
    )
    assert PAUSED in live.log()
    wait_for(lambda: "gives up its boot" in live.log(), 20, "the paused execution given up with its lease")
    assert len(found.executions) == 2 and not found.stale, str(found)


# Its presence connection keeps ending and is made again each time within the forfeit's 1.5 s, while its
# renewals are refused: before, each connection made again disarmed the forfeit, and a sweep that had
# marked the boot missing while it was lost judged it the next time it was: recovered 4.47 s in, while
# the stale execution acted 2.67 s more (11 side effects), until its lease's margin.
def test_a_live_worker_whose_presence_keeps_ending_while_its_renewals_fail_stops_its_task_before_it_is_judged(
    workers: Any, redis_client: Any
) -> None:
    port = int(redis_client.connection_pool.connection_kwargs["port"])
    user = "celery-orphans-flapping"
    redis_client.acl_setuser(
        user, enabled=True, passwords=["+flapping"], commands=["+@all"], keys=["*"], channels=["*"]
    )
    link = TcpProxy(port, only=CLIENT_NAME.encode())
    done = threading.Event()

    def flap() -> None:
        while not done.is_set():
            link.cut()
            done.wait(1.2)
            link.restore()
            done.wait(0.15)

    try:
        url = f"redis://{user}:flapping@127.0.0.1:{link.port}/0"
        env = {"CELERY_ORPHANS_REDIS_URL": url}
        live, result = tick_beside_a_watcher(workers, "flapping", 14, env=env, shared=FORFEITS)
        redis_client.acl_setuser(user, enabled=True, commands=["-evalsha", "-eval"])  # its renewals refused
        threading.Thread(target=flap, daemon=True).start()
        # Until the stale execution stops: given up by the worker, or (before) its lease's margin.
        found = quiet(result.id, seconds=3, timeout=30, execution=overlap(result.id).executions[0])
        done.set()
        wait_for_a_recovered_execution(result.id)  # given up, its lease dropped: a sweep recovers it
        found = quiet(result.id, seconds=3, timeout=60)
    finally:
        done.set()
        link.close()
        redis_client.acl_deluser(user)

    report(
        "presence connection ending again and again while renewals fail",
        faulted=link.faulted,
        executions=len(found.executions),
        stale_effects=found.count,
        overlap_seconds=found.window,
    )
    assert PAUSED in live.log()
    assert len(found.executions) == 2 and not found.stale, str(found)
