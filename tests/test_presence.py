"""Presence: a worker alone in its pid namespace (a container of its own), killed, is recovered once Redis
drops its presence connection, long before its lease could lapse; a live worker whose presence connection
alone is reset, blackholed, delayed or cut one way, while its renewals go on, is never judged gone. Real
workers, a real Redis, real signals; the presence link alone goes through a proxy that faults it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from celery import current_app

from celery_orphans import leases
from celery_orphans.models import OrphanEvent
from celery_orphans.store import Keys
from celery_orphans.worker.presence import CLIENT_NAME
from tests.helpers import finishes, ledger_env, started_on, starts, wait_for
from tests.services import DOWN, UP, Mode, TcpProxy
from tests.workers import OWN_SWEEPS_ON, process_tree

pytestmark = pytest.mark.worker

# Renewals 2 s apart and a 10 s lease, as by default: a boot whose presence is lost is judged once its
# executions are forfeit (8 s after its last renewal), before its lease lapses; the evidence says which told.
TIMINGS = {"CELERY_ORPHANS_HEARTBEAT_SECONDS": "2", "CELERY_ORPHANS_LEASE_SECONDS": "10"}
# A lease no freeze here outlives, for the worker frozen across a restart of its ledger.
LONG_LEASE = {"CELERY_ORPHANS_LEASE_SECONDS": "120"}
# A pid namespace of its own, as a container gives: no worker outside it can see its processes. Its
# settings are the test project's plain ones (its services from the environment): the suite's would look
# for the run that owns them by a process id that means nothing inside the namespace.
ALONE = ("unshare", "--pid", "--fork", "--mount-proc", "env", "DJANGO_SETTINGS_MODULE=testproject.settings")
# The same, with a process of its own as the namespace's init, so that the worker's main process can be
# killed alone (under tini or dumb-init, a container's main process is not its pid 1 either).
UNDER_INIT = (*ALONE, sys.executable, "-c", "import subprocess, sys; sys.exit(subprocess.call(sys.argv[1:]))")


def alone_possible() -> bool:
    return subprocess.run([*ALONE, "true"], capture_output=True).returncode == 0


needs_pid_namespace = pytest.mark.skipif(not alone_possible(), reason="unshare cannot make a pid namespace")


def event_of(task_id: str, timeout: float = 40) -> OrphanEvent:
    return wait_for(lambda: OrphanEvent.objects.filter(task_id=task_id).first(), timeout, "the recovery")


def doomed_and_watcher(
    workers: Any, name: str, seconds: float, shared: dict[str, str] | None = None, **doomed: Any
) -> tuple[Any, Any]:
    from demoapp.tasks import summarize

    workers.own_sweeps = {**OWN_SWEEPS_ON, **TIMINGS, **(shared or {})}  # no Beat: the watch alone
    victim = workers.start(f"doomed-{name}@test", queues=(name,), **doomed)
    workers.start(f"watcher-{name}@test")
    result = summarize.apply_async(([1, 2],), {"seconds": seconds}, queue=name)
    started_on(result.id, f"doomed-{name}@test")
    current_app.control.add_consumer(name, destination=[f"watcher-{name}@test"], reply=True, timeout=5)
    # Its presence recorded by a renewal of its own: the first comes at once once it has subscribed.
    member_of = Keys.current().presence
    wait_for(
        lambda: any(f"doomed-{name}@test" in k.decode() for k in _redis().hkeys(member_of)),
        10,
        "the doomed worker's presence to be recorded",
    )
    return victim, result


def _redis() -> Any:
    from celery_orphans.store import client

    return client()


@needs_pid_namespace
def test_a_worker_alone_in_its_pid_namespace_killed_is_recovered_by_its_presence_not_its_lease(
    workers: Any,
) -> None:
    victim, result = doomed_and_watcher(workers, "alone", 15, wrapper=ALONE)

    victim.kill()
    killed = time.monotonic()

    event = event_of(result.id)
    recovered_after = time.monotonic() - killed
    print(f"presence: killed worker recovered {recovered_after:.2f} s after the kill")
    assert (event.action, event.trigger, event.evidence) == ("recovered", "watch", "presence_lost")
    assert result.get(timeout=60) == 3
    assert (starts(result.id), finishes(result.id)) == (2, 1)


@needs_pid_namespace
def test_the_pool_process_of_a_main_process_killed_alone_dies_with_it_before_its_task_is_recovered(
    workers: Any,
) -> None:
    victim, result = doomed_and_watcher(workers, "main-alone", 15, wrapper=UNDER_INIT)
    tree = process_tree(victim.pid)  # unshare, the namespace's init, the main process, its pool process
    children = [p for p in tree if not any(_parent(q) == p for q in tree)]
    main = _parent(children[0])
    assert len(tree) == 4 and main in tree, tree

    os.kill(main, signal.SIGKILL)

    event = event_of(result.id)
    assert (event.action, event.trigger, event.evidence) == ("recovered", "watch", "presence_lost")
    # The kernel killed its pool process with it: nothing of the first execution ran on.
    assert not [p for p in children if Path(f"/proc/{p}").exists() and _state(p) != "Z"], children
    assert result.get(timeout=60) == 3
    assert (starts(result.id), finishes(result.id)) == (2, 1)


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


# --- faults on the presence link alone, renewals going on ----------------------------------------------


# Each fault on the presence link alone (``TcpProxy`` with ``only``: the connections that name themselves
# presence connections with ``CLIENT SETNAME``); every other one, the renewals' among them, passes.
FAULTS: dict[str, tuple[Mode, dict[str, Any]]] = {
    "reset": (Mode.CLOSE, {}),  # both ends closed: the worker hears it
    # Redis's end closed, the worker's held silent (a middlebox)
    "reset_redis_end": (Mode.CLOSE_SERVER_END, {}),
    "blackhole": (Mode.BLACKHOLE, {}),  # nothing forwarded either way
    "delay": (Mode.DELAY, {"delay_ms": 1500}),  # every chunk 1.5 s late
    "one_way_up": (Mode.ONE_WAY, {"direction": UP}),  # the worker's bytes reach Redis, Redis's are held
    "one_way_down": (Mode.ONE_WAY, {"direction": DOWN}),  # the reverse
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_live_worker_whose_presence_link_alone_is_faulted_is_never_judged_gone(
    workers: Any, redis_client: Any, fault: str
) -> None:
    link = TcpProxy(int(redis_client.connection_pool.connection_kwargs["port"]), only=CLIENT_NAME.encode())
    try:
        victim, result = doomed_and_watcher(
            workers, f"live-{fault}", 16, env={"CELERY_ORPHANS_REDIS_URL": link.url()}
        )
        mode, how = FAULTS[fault]
        link.set(mode, **how)
        assert link.faulted >= 1
        time.sleep(9)  # four renewals of both, three waits of a missing presence
        link.restore()
        assert result.get(timeout=30) == 3
    finally:
        link.close()

    assert not OrphanEvent.objects.filter(task_id=result.id).exists()
    assert (starts(result.id), finishes(result.id)) == (1, 1)
    assert "gives up its boot" not in victim.log()
    assert "presence connection closed" not in "".join(w.log() for w in workers)
    assert leases.fresh_boots([victim.name], prune=False)[victim.name]


def test_a_worker_frozen_across_a_restart_of_its_ledger_is_not_judged_by_the_presence_the_restart_dropped(
    workers: Any, ledger_redis: Any
) -> None:
    # Every presence vanishes at once, as in a failover; the frozen worker cannot subscribe again nor
    # renew for longer than the wait. Its presence was seen on the server before the restart, not on this
    # one: nothing may be judged by it.
    shared = {**ledger_env(ledger_redis), **LONG_LEASE}
    victim, result = doomed_and_watcher(workers, "restart", 16, shared=shared)
    os.killpg(victim.pid, signal.SIGSTOP)
    try:
        ledger_redis.stop()
        ledger_redis.start()
        time.sleep(8)  # the watcher renewed on the new server, more than three waits of a missing presence
    finally:
        os.killpg(victim.pid, signal.SIGCONT)

    assert result.get(timeout=60) == 3
    assert not OrphanEvent.objects.filter(task_id=result.id).exists()
    assert (starts(result.id), finishes(result.id)) == (1, 1)
    assert "presence connection closed" not in "".join(w.log() for w in workers)
