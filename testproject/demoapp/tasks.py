"""Example tasks: a recoverable summary, a scan that must never run twice, and helpers for tests.

Every execution is recorded in Redis (``demo:runs:<task id>``: one ``start`` and one ``finish`` line
per execution) so tests and the demo count executions, not states.
"""

import os
import signal
import time
from typing import Any

import redis
from billiard import current_process
from celery import shared_task
from celery.exceptions import Reject
from celery.signals import task_success
from django.conf import settings

import celery_orphans
from celery_orphans import recoverable
from demoapp import slow_start  # noqa: F401  (a consumer slowed for tests, when asked)


def _redis() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL)


def _record(task_id: str, event: str) -> None:
    _redis().rpush(f"demo:runs:{task_id}", f"{event}:{os.getpid()}:{time.time()}")


def runs(task_id: str) -> list[str]:
    """Execution events of a task id, oldest first."""
    return [e.decode() for e in _redis().lrange(f"demo:runs:{task_id}", 0, -1)]


def _sleep_steps(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(min(0.05, max(0.0, end - time.monotonic())))


@recoverable(group="summaries")
@shared_task(bind=True, name="demoapp.summarize")
def summarize(self: Any, numbers: list[int], seconds: float = 0.0) -> int:
    """Idempotent: recomputes a sum from its arguments."""
    _record(self.request.id, "start")
    _sleep_steps(seconds)
    _record(self.request.id, "finish")
    return sum(numbers)


@shared_task(bind=True, name="demoapp.scan")
def scan(self: Any, target: str, seconds: float = 0.0) -> str:
    """Not idempotent (imagine it files tickets): never re-run automatically."""
    _record(self.request.id, "start")
    _sleep_steps(seconds)
    _record(self.request.id, "finish")
    return f"scanned {target}"


@recoverable
@shared_task(bind=True, name="demoapp.add")
def add(self: Any, x: int, y: int, seconds: float = 0.0) -> int:
    _record(self.request.id, "start")
    _sleep_steps(seconds)
    _record(self.request.id, "finish")
    return x + y


@recoverable
@shared_task(bind=True, name="demoapp.echo")
def echo(self: Any, *args: Any, seconds: float = 0.0, **kwargs: Any) -> dict[str, Any]:
    """Returns its arguments and the recovery metadata it was given."""
    _record(self.request.id, "start")
    _sleep_steps(seconds)
    _record(self.request.id, "finish")
    return {"args": list(args), "kwargs": kwargs, "recovery": getattr(self.request, "celery_orphans", None)}


@recoverable
@shared_task(bind=True, name="demoapp.collect")
def collect(self: Any, values: list[int]) -> int:
    """A chord body."""
    _record(self.request.id, "start")
    _record(self.request.id, "finish")
    return sum(values)


@recoverable(max_attempts=2)
@shared_task(bind=True, name="demoapp.poison")
def poison(self: Any) -> None:
    """Kills the worker running it, every time."""
    _record(self.request.id, "start")
    time.sleep(0.2)
    if current_process().name != "MainProcess":  # a prefork pool child: take the main process too
        os.kill(os.getppid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


@recoverable
@shared_task(bind=True, name="demoapp.fail")
def fail(self: Any) -> None:
    _record(self.request.id, "start")
    raise ValueError("this task always fails")


@recoverable
@shared_task(bind=True, name="demoapp.retry_once", max_retries=3)
def retry_once(self: Any) -> int:
    _record(self.request.id, "start")
    if self.request.retries == 0:
        raise self.retry(countdown=0.2)
    _record(self.request.id, "finish")
    return self.request.retries


@recoverable
@shared_task(bind=True, name="demoapp.overrun", time_limit=1)
def overrun(self: Any, seconds: float = 5.0) -> None:
    _record(self.request.id, "start")
    _sleep_steps(seconds)


@recoverable(max_attempts=2)
@shared_task(bind=True, name="demoapp.lose_pool_process")
def lose_pool_process(self: Any, times: int = 99) -> str:
    """Kills the pool process running it (as the OOM killer would) on its first ``times`` runs."""
    _record(self.request.id, "start")
    if sum(1 for e in runs(self.request.id) if e.startswith("start")) <= times:
        os.kill(os.getpid(), signal.SIGKILL)
    _record(self.request.id, "finish")
    return "survived"


@recoverable
@shared_task(bind=True, name="demoapp.spin")
def spin(self: Any, seconds: float) -> int:
    """Busy in a tight Python loop, never sleeping, for ``seconds``."""
    _record(self.request.id, "start")
    end = time.monotonic() + seconds
    count = 0
    while time.monotonic() < end:
        count += 1
    _record(self.request.id, "finish")
    return count


@recoverable
@shared_task(bind=True, name="demoapp.count_steps", max_retries=1)
def count_steps(
    self: Any, steps: int, seconds: float = 0.0, retry_at: int | None = None, fail_at: int | None = None
) -> int:
    """Counts to ``steps``, saving a checkpoint after each step, so a recovered run resumes.

    Each run records ``start@<checkpoint it resumed from>``; every step executed increments
    ``demo:steps:<task id>``. ``retry_at`` makes the first run retry (Celery's retry) at that step,
    ``fail_at`` makes any run fail there.
    """
    checkpoint = celery_orphans.checkpoint(self)
    done = checkpoint.value or 0
    _record(self.request.id, f"start@{done}")
    for step in range(done + 1, steps + 1):
        if step == retry_at and self.request.retries == 0:
            raise self.retry(countdown=0.1)
        if step == fail_at:
            raise ValueError(f"failed at step {step}")
        _sleep_steps(seconds)
        _redis().incr(f"demo:steps:{self.request.id}")
        checkpoint.save(step)
    _record(self.request.id, "finish")
    return steps


def steps_executed(task_id: str) -> int:
    """How many steps every run of a ``count_steps`` task executed, together."""
    return int(_redis().get(f"demo:steps:{task_id}") or 0)


# Appends one side effect, stamped by the Redis server that keeps it: every worker's effects share one
# clock, whatever the clock of the worker that made them says.
_EFFECT = """
local now = redis.call('TIME')
return redis.call('RPUSH', KEYS[1], ARGV[1] .. ':' .. now[1] .. '.' .. string.format('%06d', now[2]))
"""


def _effect(task_id: str, execution: str, seq: int) -> None:
    _redis().eval(_EFFECT, 1, f"demo:effects:{task_id}", f"{execution}:{os.getpid()}:{seq}:{time.time()}")


def effects(task_id: str) -> list[str]:
    """Side effects of a task id, oldest first: ``execution:pid:seq:local time:server time``."""
    return [e.decode() for e in _redis().lrange(f"demo:effects:{task_id}", 0, -1)]


@recoverable
@shared_task(bind=True, name="demoapp.tick")
def tick(self: Any, seconds: float, every: float = 0.5) -> int:
    """Acts on the world every ``every`` seconds for ``seconds``: each act is a side effect that a stale
    execution must not make once a recovered one has started (tests/faults.py checks the overlap)."""
    _record(self.request.id, "start")
    seq = _act(self.request.id, seconds, every)
    _record(self.request.id, "finish")
    return seq


def _act(task_id: str, seconds: float, every: float) -> int:
    """One execution's side effects, every ``every`` seconds for ``seconds``; how many it made."""
    execution = os.urandom(4).hex()
    end = time.monotonic() + seconds
    seq = 0
    while True:
        _effect(task_id, execution, seq)
        seq += 1
        left = end - time.monotonic()
        if left <= 0:
            return seq
        _sleep_steps(min(every, left))


@recoverable
@shared_task(bind=True, name="demoapp.locked_tick")
def locked_tick(self: Any, key: int, seconds: float, every: float = 0.25) -> int:
    """``tick`` inside a database transaction that holds PostgreSQL's advisory lock ``key`` (as a row lock
    would be held): a second execution waits for the first's transaction to end. Records ``locked`` in
    its runs once it holds the lock."""
    from django.db import connection, transaction

    _record(self.request.id, "start")
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_xact_lock(%s)", [key])
        _record(self.request.id, "locked")
        seq = _act(self.request.id, seconds, every)
    _record(self.request.id, "finish")
    return seq


@recoverable
@shared_task(bind=True, name="demoapp.requeue_once")
def requeue_once(self: Any, seconds: float = 0.0) -> str:
    """Gives its message back to the broker (``Reject(requeue=True)``) after ``seconds`` the first time it
    runs."""
    _record(self.request.id, "start")
    if sum(1 for e in runs(self.request.id) if e.startswith("start")) == 1:
        _sleep_steps(seconds)
        raise Reject("back to the queue, once", requeue=True)
    _record(self.request.id, "finish")
    return "ran after a requeue"


@task_success.connect
def _stored(sender: Any = None, **kwargs: Any) -> None:
    # Sent once an execution's result is handled: what counts as a task's finishing, whatever its body
    # did before. A forfeit execution never gets here.
    if getattr(sender, "name", "").startswith("demoapp."):
        _redis().rpush(f"demo:stored:{sender.request.id}", f"{os.getpid()}:{time.time()}")


def stored(task_id: str) -> int:
    """How many executions of a task id finished (had their outcome handled as a success)."""
    return int(_redis().llen(f"demo:stored:{task_id}"))
