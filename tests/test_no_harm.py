"""Do no harm: on a healthy fleet, every Celery feature behaves the same with celery-orphans as without.

The same workload (tests/noharm.py) runs on plain Celery (the test project without the extension, the
same delivery settings) and with celery-orphans and Beat sending its sweep every second (each body runs
long enough for two sweeps to look at it), no fault injected; what each scenario left is compared: states,
what ``get()`` gave, the executions of each task, what was revoked, marked terminal or audited. A
difference is a bug unless docs/supported.md names it.

By default (CI) the prefork pool runs every scenario and the threads pool a sample;
``TEST_CELERY_ORPHANS_NO_HARM=full`` runs every scenario on every pool.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from django_celery_beat.models import IntervalSchedule, PeriodicTask

from celery_orphans.models import OrphanEvent
from tests import noharm
from tests.helpers import database_url, wait_for
from tests.workers import LEAN_FLAGS, OWN_SWEEPS_ON, PROJECT, SPAWN, SPAWN_FLAGS, WorkerPool

pytestmark = pytest.mark.worker

FULL = os.environ.get("TEST_CELERY_ORPHANS_NO_HARM") == "full"
POOLS = ["prefork", *SPAWN, "threads", *(["solo", "gevent", "eventlet"] if FULL else [])]
# The sample the threads pool runs by default: the features a pool changes least stay with prefork.
SAMPLE = {"replace into chain", "replace into chord", "chord with a failing member and link_error",
          "Ignore", "Reject with requeue", "retry with countdown", "revoke while it runs"}  # fmt: skip
CONCURRENCY = {"prefork": 4, "spawn": 4, "threads": 8, "solo": 1, "gevent": 8, "eventlet": 8}
SWEEP_QUEUE = "noharm-sweeps"
INCLUDE = ("demoapp.noharm",)


def applicable(pool: str) -> list[noharm.Scenario]:
    found = [s for s in noharm.scenarios() if s.pools is None or pool in s.pools]
    if not FULL and pool != "prefork":
        found = [s for s in found if s.name in SAMPLE]
    return found


@contextlib.contextmanager
def beat(workers: WorkerPool) -> Iterator[None]:
    """Beat sending the sweep every second, to a worker of its own (the workload's pool stays the test's)."""
    PeriodicTask.objects.all().delete()
    every, _ = IntervalSchedule.objects.get_or_create(every=1, period=IntervalSchedule.SECONDS)
    PeriodicTask.objects.create(
        name="no harm: sweep", task="celery_orphans.reconcile", interval=every, queue=SWEEP_QUEUE
    )
    sweeper = workers.start(
        "sweeper@test", queues=(SWEEP_QUEUE,), include=INCLUDE, env={"CELERY_ORPHANS_GRACE_SECONDS": "0.5"}
    )
    log = open(workers.tmp_path / "beat.log", "ab")  # noqa: SIM115 - closed below
    process = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "testproject", "beat", "-S", "django", "--loglevel=INFO"],
        cwd=PROJECT,
        env={**workers.env, "PYTHONPATH": workers.env["PYTHONPATH"]},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        from demoapp.noharm import sweeps

        wait_for(lambda: len(sweeps()) >= 1, 60, "Beat's first sweep")
        yield
    finally:
        process.kill()
        process.wait(10)
        log.close()
        sweeper.kill()  # nor its own sweeps: the plain run's rows are no business of theirs


def _run(
    workers: WorkerPool, pool: str, plain: bool
) -> tuple[list[noharm.Scenario], dict[str, dict[str, Any]]]:
    from demoapp.noharm import sweeps

    name = f"{'plain' if plain else 'orphans'}-{pool}@test"
    env = {"TESTPROJECT_PLAIN": "1"} if plain else {}
    flags = SPAWN_FLAGS if pool == "spawn" else LEAN_FLAGS
    worker = workers.start(
        name,
        pool="prefork" if pool == "spawn" else pool,
        concurrency=CONCURRENCY[pool],
        include=INCLUDE,
        env=env,
        flags=flags,
    )

    def quiet() -> None:
        if not plain:  # two more sweeps over what is left, as a user's fleet would have them
            seen = len(sweeps())
            wait_for(lambda: len(sweeps()) >= seen + 2, 30, "two more sweeps")

    cells = applicable(pool)
    try:
        with contextlib.nullcontext() if plain else beat(workers):
            return cells, noharm.run_all(cells, quiet)
    finally:
        worker.kill()


@pytest.mark.parametrize("pool", POOLS)
def test_every_feature_ends_the_same_with_and_without_celery_orphans(workers: WorkerPool, pool: str) -> None:
    from demoapp.noharm import sweeps

    workers.own_sweeps = OWN_SWEEPS_ON
    cells, with_orphans = _run(workers, pool, plain=False)
    _, plain = _run(workers, pool, plain=True)

    differences = {
        s.name: {"plain": plain[s.name], "celery-orphans": with_orphans[s.name]}
        for s in cells
        if _compared(plain[s.name]) != _compared(with_orphans[s.name])
    }
    assert not differences, (sorted(differences), differences)
    events = list(
        OrphanEvent.objects.values("task_id", "task_name", "action", "reason", "evidence", "detail")
    )
    print("audited:", events)
    audited = {s.name: with_orphans[s.name]["audited"] for s in cells}
    assert audited == {s.name: s.audited for s in cells}
    assert len(events) == sum(s.audited for s in cells), events
    looked = {s.name: noharm.looked_at(s, sweeps()) for s in cells}
    assert all(n >= 2 for n in looked.values() if n >= 0), looked
    print(f"no harm on {pool}: {len(cells)} (feature x pool) cells compared, sweeps per task {looked}")


def _compared(observed: dict[str, Any]) -> dict[str, Any]:
    # The audit rows are compared with what each scenario keeps on purpose, above.
    return {k: v for k, v in observed.items() if k != "audited"}


def test_eager_calls_end_the_same_with_and_without_celery_orphans(transactional_db: None) -> None:
    def outcomes(plain: bool) -> dict[str, Any]:
        script = (
            "import django, json; django.setup(); "
            "from demoapp.noharm import eager_outcomes as o; print(json.dumps(o()))"
        )
        env = {**os.environ, "DATABASE_URL": database_url(), "DJANGO_SETTINGS_MODULE": "testproject.settings"}
        done = subprocess.run(
            [sys.executable, "-c", script],
            cwd=PROJECT,
            env={**env, "TESTPROJECT_PLAIN": "1" if plain else "0"},
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        return json.loads(done.stdout.strip().splitlines()[-1])

    with_orphans, plain = outcomes(plain=False), outcomes(plain=True)

    assert with_orphans == plain
    assert plain["apply replace into chain"] == {
        "state": "SUCCESS", "value": 3, "ran": ["noharm.replace_me", "noharm.step", "noharm.step"]
    }  # fmt: skip
