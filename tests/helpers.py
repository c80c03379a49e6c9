"""The helpers the tests share: waiting for a condition, running ``manage.py`` as a script would, and
reading leases and forked children."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import redis
from celery import Celery, current_app
from celery.result import AsyncResult
from django_celery_results.models import TaskResult

from celery_orphans import sweep
from celery_orphans.decision import Action
from celery_orphans.exceptions import SweepLocked
from celery_orphans.models import Trigger
from celery_orphans.registry import RecoveryPolicy, policy_of
from celery_orphans.store import Keys
from celery_orphans.worker.heartbeat import Heartbeat

ROOT = Path(__file__).resolve().parent.parent
MakeHeartbeat = Callable[..., Heartbeat]


def policy_for(name: str, app: Celery | None = None) -> RecoveryPolicy | None:
    """The policy of the task registered under ``name`` (``None``: unknown, or not recoverable)."""
    task = (app or current_app).tasks.get(name)
    return None if task is None else policy_of(task)


def wait_for(
    condition: Callable[[], object], timeout: float = 10.0, what: str = "a condition", interval: float = 0.05
) -> object:
    """Poll ``condition`` until it returns something truthy; fail with ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


def database_url() -> str:
    """The URL of the database this process uses (the test database once it is set up)."""
    from django.db import connection

    s = connection.settings_dict
    if s["ENGINE"].endswith("sqlite3"):
        return f"sqlite:///{s['NAME']}"
    auth = quote(s["USER"] or "")
    if s["PASSWORD"]:
        auth += ":" + quote(s["PASSWORD"])
    if s["ENGINE"].endswith("mysql"):
        port = f":{s['PORT']}" if s["PORT"] else ""
        return f"mysql://{auth}@{s['HOST'] or 'localhost'}{port}/{s['NAME']}"
    return f"postgres://{auth}@{s['HOST'] or '127.0.0.1'}:{s['PORT'] or 5432}/{s['NAME']}"


def manage(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``manage.py *args`` of the test project in a process of its own, on the test database."""
    environ = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "testproject.test_settings",
        "DATABASE_URL": database_url(),
        "PYTHONPATH": str(ROOT),
        **(env or {}),
    }
    return subprocess.run(
        [sys.executable, "testproject/manage.py", *args],
        cwd=ROOT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def ledger_env(server: Any) -> dict[str, str]:
    """Environment for a worker whose ledger is the Redis ``server`` (a ``RedisServer``, or a proxy in front
    of one): the test project reads it before REDIS_URL, which keeps its broker and the tasks' records."""
    return {"CELERY_ORPHANS_REDIS_URL": server.url()}


def lease_key(heartbeat: Heartbeat) -> str:
    return Keys.current().lease(heartbeat.node, heartbeat.boot)


def boots_of(redis_client: redis.Redis, node: str) -> set[str]:
    return {b.decode() for b in redis_client.hkeys(Keys.current().boots(node))}


def lease_of_exited_process(node: str, boot: str) -> int:
    """A forked process that takes a lease as ``boot`` of ``node`` and exits without giving it up."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = 0 if Heartbeat(node, boot=boot).renew() else 2
        finally:
            os._exit(code)
    assert exit_code_of(pid) == 0
    return pid


def exit_code_of(pid: int, timeout: float = 10.0) -> int:
    deadline = time.monotonic() + timeout
    while (waited := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(f"the forked child {pid} did not exit")
        time.sleep(0.01)
    return os.waitstatus_to_exitcode(waited[1])


def lapse(redis_client: redis.Redis, node: str, boot: str) -> None:
    """End a boot's lease as time would: the key goes, and its node's record says its renewal expired."""
    keys = Keys.current()
    seconds, micros = redis_client.time()
    now_ms = seconds * 1000 + micros // 1000
    redis_client.delete(keys.lease(node, boot))
    redis_client.hset(keys.boots(node), boot, f"{now_ms - 1000}:{now_ms}")


# --- tasks of the test project run by real workers ------------------------------------------------


def started_on(task_id: str, worker: str, timeout: float = 20) -> TaskResult:
    """Wait until the task runs on ``worker``: its STARTED row, and its body's first line (written after)."""
    row = wait_for(
        lambda: TaskResult.objects.filter(task_id=task_id, status="STARTED", worker=worker).first(),
        timeout,
        f"{task_id} STARTED on {worker}",
    )
    wait_for(lambda: starts(task_id) >= 1, timeout, f"{task_id} to begin its body")
    return row


def sweep_now(**kwargs: object) -> sweep.Report:
    """One sweep now, with no grace period, as the command would run it; while a worker's own sweep (its
    boot sweep, its watch) holds the lock, once that one is done."""
    options = sweep.Options(trigger=Trigger.COMMAND, grace_seconds=0, **kwargs)
    deadline = time.monotonic() + 30
    while True:
        try:
            return sweep.run(options)
        except SweepLocked:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.1)


def active_on(app: Any, node: str) -> set[str] | None:
    """The ids of the tasks ``node`` runs now, by its own answer; ``None`` when it does not answer."""
    replies = app.control.inspect([node], timeout=1).active() or {}
    return None if node not in replies else {task["id"] for task in replies[node]}


QUEUE = "celery"  # the test project's default queue


def published(redis_client: redis.Redis, queue: str = QUEUE) -> list[dict[str, Any]]:
    """The headers of every message waiting in ``queue`` (the Redis transport keeps them as JSON)."""
    return [json.loads(raw)["headers"] for raw in redis_client.lrange(queue, 0, -1)]


def published_ids(redis_client: redis.Redis, queue: str = QUEUE) -> Counter[str]:
    """How many messages wait in ``queue``, by task id."""
    return Counter(headers["id"] for headers in published(redis_client, queue))


def outcome_of(report: sweep.Report, task_id: str) -> sweep.Outcome:
    [found] = [o for o in report.outcomes if o.decision.task_id == task_id]
    return found


def sweep_until(task_id: str, *actions: Action, timeout: float = 20) -> sweep.Outcome:
    """Sweep until the task gets one of ``actions`` (a killed worker's lease takes a moment to lapse)."""

    def attempt() -> sweep.Outcome | None:
        found = [o for o in sweep_now().outcomes if o.decision.task_id == task_id]
        return found[0] if found and found[0].decision.action in actions and found[0].done else None

    wanted = " or ".join(a.value for a in actions)
    return wait_for(attempt, timeout, f"{task_id} to be {wanted}", interval=0.3)


def dropped_a_stale_copy(log: str) -> bool:
    """Whether a worker's log says it dropped a stale copy unrun: by its fence (a recovery sent a later
    copy), or, for a redelivery, by its result row (the task already ended)."""
    return "dropped a stale copy" in log or "dropped a redelivery" in log


def starts(task_id: str) -> int:
    from demoapp.tasks import runs

    return sum(1 for e in runs(task_id) if e.startswith("start"))


def finishes(task_id: str) -> int:
    from demoapp.tasks import runs

    return sum(1 for e in runs(task_id) if e.startswith("finish"))


def summarize_on_a_doomed_worker(
    workers: Any,
    name: str,
    *,
    seconds: float,
    env: dict[str, str] | None = None,
    pool: str = "prefork",
    flags: tuple[str, ...] | None = None,
) -> tuple[Any, AsyncResult]:
    """``task_on_a_doomed_worker`` running ``summarize([2, 3])`` (5) for ``seconds``."""
    from demoapp.tasks import summarize

    return task_on_a_doomed_worker(
        workers,
        name,
        lambda queue: summarize.apply_async(([2, 3],), {"seconds": seconds}, queue=queue),
        env=env,
        pool=pool,
        flags=flags,
    )


def task_on_a_doomed_worker(
    workers: Any,
    name: str,
    send: Callable[[str], AsyncResult],
    *,
    env: dict[str, str] | None = None,
    doomed_env: dict[str, str] | None = None,
    pool: str = "prefork",
    flags: tuple[str, ...] | None = None,
) -> tuple[Any, AsyncResult]:
    """Start ``doomed-{name}@test`` (``pool``, and ``flags`` if given) on a queue of its own and
    ``watcher-{name}@test``, both sweeping for themselves (``env`` for both, ``doomed_env`` for the doomed
    one on top); ``send(queue)`` a task that runs on the doomed one, then have the watcher take that queue
    too, where a recovery of the task then runs. Returns the doomed worker and the result."""
    from celery import current_app

    from tests.workers import OWN_SWEEPS_ON

    workers.own_sweeps = OWN_SWEEPS_ON
    doomed = workers.start(
        f"doomed-{name}@test",
        pool=pool,
        env={**(env or {}), **(doomed_env or {})},
        queues=(name,),
        **({"flags": flags} if flags is not None else {}),
    )
    workers.start(f"watcher-{name}@test", env=env)
    result = send(name)
    started_on(result.id, f"doomed-{name}@test")
    current_app.control.add_consumer(name, destination=[f"watcher-{name}@test"], reply=True, timeout=5)
    return doomed, result
