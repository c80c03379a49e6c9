"""Worker leases against a real Redis: the key a heartbeat keeps alive, and what the sweep reads from it."""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import pytest
import redis
from pytest_django import Settings

from celery_orphans import leases, processes
from celery_orphans.leases import fresh_boots
from celery_orphans.store import Keys
from tests.helpers import MakeHeartbeat, boots_of, lease_key, lease_of_exited_process, wait_for

# --- the lease ------------------------------------------------------------------------------------


def test_fresh_boots_reports_every_live_boot_under_each_node(
    make_heartbeat: MakeHeartbeat, redis_client: redis.Redis, node: str
) -> None:
    first, second, elsewhere = make_heartbeat(node), make_heartbeat(node), make_heartbeat(f"{node}-2")
    for heartbeat in (first, second, elsewhere):
        heartbeat.start()

    found = fresh_boots([node, f"{node}-2", "celery@nobody", node])

    assert found == {
        node: frozenset({first.boot, second.boot}),
        f"{node}-2": frozenset({elsewhere.boot}),
        "celery@nobody": frozenset(),
    }
    assert fresh_boots([]) == {}
    assert fresh_boots([node], redis_client) == {node: frozenset({first.boot, second.boot})}


def test_a_lease_that_is_not_renewed_lapses_on_its_own(
    make_heartbeat: MakeHeartbeat, redis_client: redis.Redis, short_lease: Settings, node: str
) -> None:
    stale, live = make_heartbeat(node), make_heartbeat(node)
    stale.renew()  # once, and never again
    live.start()
    assert fresh_boots([node])[node] == {stale.boot, live.boot}
    live.stop()
    started = time.monotonic()

    wait_for(lambda: not fresh_boots([node])[node], what="the lease to lapse")

    assert time.monotonic() - started < 5
    assert redis_client.exists(lease_key(stale)) == 0


def test_a_lapsed_boot_does_not_stay_listed_under_its_node(
    make_heartbeat: MakeHeartbeat, redis_client: redis.Redis, short_lease: Settings, node: str
) -> None:
    short_lease.CELERY_ORPHANS_HEARTBEAT_SECONDS = 60
    crashed = make_heartbeat(node)
    crashed.renew()  # never stopped: as after SIGKILL
    wait_for(lambda: not fresh_boots([node])[node], what="the lease to lapse")

    assert crashed.boot not in boots_of(redis_client, node)


# --- telling a live twin from a boot killed a moment ago --------------------------------------------


def test_renewals_reads_each_boots_current_lease_value(
    make_heartbeat: MakeHeartbeat, redis_client: redis.Redis, node: str
) -> None:
    heartbeat = make_heartbeat(node)
    heartbeat.renew()

    values = leases.renewals(node, [heartbeat.boot, "never-was"])

    assert values == {heartbeat.boot: redis_client.get(lease_key(heartbeat)), "never-was": None}
    assert leases.renewals(node, []) == {}
    assert leases.renewals(node, [heartbeat.boot], redis_client) == {heartbeat.boot: values[heartbeat.boot]}


def test_renewed_within_reports_a_boot_that_keeps_beating(
    make_heartbeat: MakeHeartbeat, short_lease: Settings, node: str
) -> None:
    heartbeat = make_heartbeat(node)
    heartbeat.start()
    started = time.monotonic()

    assert leases.renewed_within(node, [heartbeat.boot], 5) == {heartbeat.boot}
    assert time.monotonic() - started < 2  # it answers at the first renewal, not at the deadline


def test_renewed_within_leaves_out_a_lease_that_stands_still(
    make_heartbeat: MakeHeartbeat, short_lease: Settings, node: str
) -> None:
    short_lease.CELERY_ORPHANS_LEASE_SECONDS = 30
    frozen = make_heartbeat(node)  # its lease stays, unrenewed, as a process killed a moment ago leaves it
    frozen.renew()
    live = make_heartbeat(node)
    live.start()

    assert leases.renewed_within(node, [frozen.boot, live.boot, "never-was"], 1) == {live.boot}


def test_renewed_within_does_not_wait_for_a_boot_whose_process_is_gone_from_this_host(
    make_heartbeat: MakeHeartbeat, redis_client: redis.Redis, short_lease: Settings, node: str
) -> None:
    short_lease.CELERY_ORPHANS_LEASE_SECONDS = 30
    pid = lease_of_exited_process(node, "dead")
    assert json.loads(redis_client.get(Keys.current().lease(node, "dead")))["pid"] == pid
    started = time.monotonic()

    assert leases.renewed_within(node, ["dead"], 5) == frozenset()
    assert time.monotonic() - started < 1


def test_record_exits_records_gone_a_boot_whose_process_exited_on_this_host_and_leaves_a_live_one(
    make_heartbeat: MakeHeartbeat, short_lease: Settings, node: str
) -> None:
    short_lease.CELERY_ORPHANS_LEASE_SECONDS = 30
    lease_of_exited_process(node, "dead")
    live = make_heartbeat(node)
    live.renew()
    assert leases.boot_states([node], prune=False)[node].alive == {"dead", live.boot}  # its lease holds

    leases.record_exits(node, ["dead", live.boot, "never-was"])

    states = leases.boot_states([node], prune=False)[node]
    assert (states.alive, states.exited) == ({live.boot}, {"dead"})


@pytest.mark.parametrize(
    "lease",
    [
        pytest.param({"machine": "another-kernel/pid:[1]"}, id="written-on-another-machine"),
        pytest.param({"machine": None}, id="written-where-no-process-can-tell"),
        pytest.param({"machine": None, "process": None}, id="written-before-processes-were-recorded"),
        pytest.param({"process": "own"}, id="written-by-this-process"),
        pytest.param({"process": "not-a-pid"}, id="unreadable-process"),
        pytest.param(None, id="not-json"),
    ],
)
def test_renewed_within_waits_out_a_lease_it_cannot_prove_dead(
    redis_client: redis.Redis, node: str, lease: dict[str, Any] | None
) -> None:
    here = processes.this()
    assert here is not None
    gone = 2**22 + 1  # above the kernel's largest pid: no process has it
    value: dict[str, Any] = {
        "node": node,
        "boot": "b",
        "pid": gone,
        "host": socket.gethostname(),
        "machine": here.machine,
        "process": f"{gone} 1",
    }
    if lease is not None:
        value.update(lease)
        if value["process"] == "own":
            value["process"] = str(here)
    redis_client.set(Keys.current().lease(node, "b"), "{not json" if lease is None else json.dumps(value))
    started = time.monotonic()

    assert leases.renewed_within(node, ["b"], 0.5) == frozenset()
    assert time.monotonic() - started >= 0.5  # watched to the deadline, not dismissed


# --- one renewal ----------------------------------------------------------------------------------


# --- processes ------------------------------------------------------------------------------------


# --- Redis failures -------------------------------------------------------------------------------


def test_count_is_the_boots_whose_last_renewal_still_holds(
    make_heartbeat: MakeHeartbeat, short_lease: Settings, node: str
) -> None:
    live, unrenewed, stopped = make_heartbeat(node), make_heartbeat(node), make_heartbeat(f"{node}-2")
    live.start()
    unrenewed.renew()
    stopped.start()
    stopped.stop()

    assert leases.count() == 2
    wait_for(lambda: leases.count() == 1, what="the unrenewed lease to lapse")
