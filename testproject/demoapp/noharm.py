"""The workload of the differential "no harm" suite (tests/test_no_harm.py): ordinary Celery features.

With ``TESTPROJECT_PLAIN=1`` the test project runs without celery-orphans (settings.py leaves the app
out) and these tasks are not ``@recoverable``; the delivery settings stay the same (the app's
``task_acks_late`` is on either way). Every execution that ends records itself under its root id
(``noharm:runs:<root id>``: the task's name, when it started and ended), so the two runs can be compared
by what ran, not only by the states left behind.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from typing import Any, TypeVar

import redis
from celery import chain, chord, group, shared_task
from celery.exceptions import Ignore, Reject, SoftTimeLimitExceeded
from celery.signals import task_postrun, task_prerun
from django.conf import settings

PLAIN = os.environ.get("TESTPROJECT_PLAIN") == "1"
T = TypeVar("T")


def maybe_recoverable(task: T) -> T:
    if PLAIN:
        return task
    from celery_orphans import recoverable

    return recoverable(task)


def _redis() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL)


def _ran(task: Any, began: float, note: str = "") -> None:
    root = task.request.root_id or task.request.id
    entry = {"name": task.name, "began": began, "ended": time.time(), "note": note}
    _redis().rpush(f"noharm:runs:{root}", json.dumps(entry))


def runs(root_id: str) -> list[dict[str, Any]]:
    return [json.loads(e) for e in _redis().lrange(f"noharm:runs:{root_id}", 0, -1)]


def _body(seconds: float) -> float:
    """Run for ``seconds``; while Beat sweeps, on until two sweeps have looked at this execution (a loaded
    machine makes a sweep slower than its schedule)."""
    began = time.time()
    time.sleep(seconds)
    deadline = time.monotonic() + 30
    while seconds and not PLAIN and _sweeping() and _swept_since(began) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    return began


def _sweeping() -> bool:
    return bool(sweeps()) and sweeps()[-1][1] > time.time() - 10


def _swept_since(began: float) -> int:
    return sum(1 for start, _ in sweeps() if start >= began)


@maybe_recoverable
@shared_task(bind=True, name="noharm.step")
def step(self: Any, x: int = 0, seconds: float = 0.0) -> int:
    began = _body(seconds)
    _ran(self, began)
    return x + 1


@shared_task(bind=True, name="noharm.plain_step")
def plain_step(self: Any, x: int = 0, seconds: float = 0.0) -> int:
    """Never ``@recoverable``: a replacement that is not."""
    began = _body(seconds)
    _ran(self, began)
    return x + 1


@maybe_recoverable
@shared_task(bind=True, name="noharm.total")
def total(self: Any, values: list[int]) -> int:
    _ran(self, time.time())
    return sum(values)


def replacement(shape: str, seconds: float, task: Any = None) -> Any:
    """What ``replace_me`` is replaced by: ``chain``, ``group``, ``chord``, ``plain`` (a chain of tasks
    that are not recoverable) or ``nested:<shape>`` (a task that replaces itself with ``shape``)."""
    s = task or step
    if shape.startswith("nested:"):
        return replace_me.si(shape.removeprefix("nested:"), seconds)
    if shape == "chain":
        return chain(s.si(1, seconds), s.s(seconds=seconds))
    if shape == "plain":
        return replacement("chain", seconds, plain_step)
    if shape == "group":
        return group(s.si(1, seconds), s.si(2, seconds))
    if shape == "chord":
        return chord([s.si(1, seconds), s.si(2, seconds)], total.s())
    raise ValueError(shape)


@maybe_recoverable
@shared_task(bind=True, name="noharm.replace_me")
def replace_me(self: Any, shape: str, seconds: float = 0.0) -> Any:
    began = _body(seconds)
    _ran(self, began, shape)
    return self.replace(replacement(shape, seconds))


@maybe_recoverable
@shared_task(bind=True, name="noharm.ignore")
def ignore(self: Any, seconds: float = 0.0) -> None:
    _ran(self, _body(seconds))
    raise Ignore()


@maybe_recoverable
@shared_task(bind=True, name="noharm.reject")
def reject(self: Any, requeue: bool, seconds: float = 0.0) -> str:
    began = _body(seconds)
    first = self.request.delivery_info.get("redelivered") is not True and not _redis().getset(
        f"noharm:rejected:{self.request.id}", 1
    )
    _ran(self, began, "rejected" if first else "")
    if first:
        raise Reject("no harm", requeue=requeue)
    return "ran again"


@maybe_recoverable
@shared_task(bind=True, name="noharm.retry", max_retries=2, default_retry_delay=0.3)
def retry(self: Any, countdown: float | None, seconds: float = 0.0) -> int:
    _ran(self, _body(seconds), f"retries={self.request.retries}")
    if self.request.retries < 2:
        raise self.retry() if countdown is None else self.retry(countdown=countdown)
    return int(self.request.retries)


@maybe_recoverable
@shared_task(bind=True, name="noharm.fail")
def fail(self: Any, seconds: float = 0.0) -> None:
    _ran(self, _body(seconds))
    raise ValueError("no harm")


@shared_task(bind=True, name="noharm.errback")
def errback(self: Any, *args: Any) -> None:
    # Celery calls an errback with (request, exc, traceback) or, for a chord's failure, with the task id.
    _ran(self, time.time(), "errback")


@maybe_recoverable
@shared_task(bind=True, name="noharm.soft_limit", soft_time_limit=0.5)
def soft_limit(self: Any, seconds: float) -> str:
    began = time.time()
    try:
        time.sleep(seconds)
    except SoftTimeLimitExceeded:
        _ran(self, began, "soft")
        return "soft limit"
    _ran(self, began)
    return "no limit"


@maybe_recoverable
@shared_task(bind=True, name="noharm.hard_limit", time_limit=0.5)
def hard_limit(self: Any, seconds: float) -> str:
    began = _body(seconds)
    _ran(self, began)
    return "no limit"


@shared_task(bind=True, name="noharm.early_ack", acks_late=False)
def early_ack(self: Any, seconds: float = 0.0) -> int:
    _ran(self, _body(seconds))
    return 1


@maybe_recoverable
@shared_task(bind=True, name="noharm.untracked", track_started=False)
def untracked(self: Any, seconds: float = 0.0) -> int:
    _ran(self, _body(seconds))
    return 1


@maybe_recoverable
@shared_task(bind=True, name="noharm.no_result", ignore_result=True)
def no_result(self: Any, seconds: float = 0.0) -> int:
    _ran(self, _body(seconds))
    return 1


@maybe_recoverable
@shared_task(bind=True, name="noharm.limited", rate_limit="4/s")
def limited(self: Any, seconds: float = 0.0) -> int:
    _ran(self, _body(seconds))
    return 1


@maybe_recoverable
@shared_task(
    bind=True,
    name="noharm.lose_pool_process",
    retry_on_worker_lost=True,
    max_retries=1,
    default_retry_delay=0.2,
)
def lose_pool_process(self: Any) -> str:
    """Kills its pool process on its first run, as the OOM killer would."""
    began = time.time()
    _redis().rpush(f"noharm:retries:{self.request.id}", self.request.retries)
    if not _redis().getset(f"noharm:lost:{self.request.root_id or self.request.id}", 1):
        _ran(self, began, "killed")
        os.kill(os.getpid(), signal.SIGKILL)
    _ran(self, began)
    return "survived"


# How often the sweep ran, and when: the suite checks that Beat's sweeps looked at every task twice.
@task_prerun.connect
def _sweep_began(sender: Any = None, **kwargs: Any) -> None:
    if getattr(sender, "name", "") == "celery_orphans.reconcile":
        _redis().rpush("noharm:sweeps", f"began:{time.time()}")


@task_postrun.connect
def _sweep_ended(sender: Any = None, **kwargs: Any) -> None:
    if getattr(sender, "name", "") == "celery_orphans.reconcile":
        _redis().rpush("noharm:sweeps", f"ended:{time.time()}")


def sweeps() -> list[tuple[float, float]]:
    """Every sweep that ran to its end: (began, ended)."""
    events = [e.decode().split(":") for e in _redis().lrange("noharm:sweeps", 0, -1)]
    began = [float(t) for kind, t in events if kind == "began"]
    ended = [float(t) for kind, t in events if kind == "ended"]
    return list(zip(began, ended, strict=False))


def eager_outcomes() -> dict[str, Any]:
    """Each eager call's state, result (or exception's name) and executions: ``.apply()`` and
    ``task_always_eager``, as users' own test suites run tasks."""
    from celery import current_app

    calls: dict[str, Callable[[], Any]] = {
        "apply": lambda: step.apply((1, 0)),
        "apply replace into chain": lambda: replace_me.apply(("chain", 0)),
        "apply replace into group": lambda: replace_me.apply(("group", 0)),
        "apply retry": lambda: retry.apply((0.0, 0)),
        "apply Ignore": lambda: ignore.apply(),
        "apply Reject": lambda: reject.apply((False, 0)),
        "apply failing": lambda: fail.apply(),
        "apply chain": lambda: chain(step.si(1), step.s()).apply(),
        "apply group": lambda: group(step.si(1), step.si(2)).apply(),
        "always eager delay": lambda: step.delay(1),
        "always eager replace": lambda: replace_me.delay("chord", 0),
    }
    found: dict[str, Any] = {}
    for name, call in calls.items():
        current_app.conf.task_always_eager = name.startswith("always eager")
        try:
            result = call()
            value = result.get(propagate=False, disable_sync_subtasks=False)
            state = result.state
        except Exception as exc:  # what the caller sees is compared, whatever it is
            value, state = type(exc).__name__, "raised"
        value = type(value).__name__ if isinstance(value, BaseException) else value
        ran = sorted(r["name"] for r in runs(result.id)) if state != "raised" else []
        found[name] = {"state": state, "value": value, "ran": ran}
    return found
