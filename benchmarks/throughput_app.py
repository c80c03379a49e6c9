"""The Celery app of the throughput benchmark: the same two tasks twice, plain and ``@recoverable``.

Configured from the test project's Django settings (our recommended Celery settings, django-db results),
so both task sets run with ``acks_late``, ``track_started`` and ``result_extended``; only the
``@recoverable`` set goes through celery-orphans' per-task hooks.

    celery -A benchmarks.throughput_app worker -P prefork -c 2
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for path in (str(ROOT), str(ROOT / "testproject")):
    if path not in sys.path:
        sys.path.insert(0, path)
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "testproject.settings")
from tests.services import BENCH_DATABASE_URL, ensure_database, provide  # noqa: E402

# A database of its own, by name, and a Redis server of its own; its workers use the same.
provide(BENCH_DATABASE_URL)
ensure_database(BENCH_DATABASE_URL)

import django  # noqa: E402

django.setup()

from celery import Celery  # noqa: E402

from celery_orphans import recoverable  # noqa: E402

app = Celery("throughput")
app.config_from_object("django.conf:settings", namespace="CELERY")

SLEEP_SECONDS = 0.01


# Each returns the pid of the pool process that ran it, so the benchmark can tell the two apart.
def _noop() -> int:
    return os.getpid()


def _sleep() -> int:
    time.sleep(SLEEP_SECONDS)
    return os.getpid()


plain_noop = app.task(name="bench.plain.noop")(_noop)
plain_sleep = app.task(name="bench.plain.sleep10ms")(_sleep)
ours_noop = recoverable(app.task(name="bench.ours.noop")(_noop))
ours_sleep = recoverable(app.task(name="bench.ours.sleep10ms")(_sleep))

TASKS = {
    ("plain", "noop"): "bench.plain.noop",
    ("plain", "sleep10ms"): "bench.plain.sleep10ms",
    ("ours", "noop"): "bench.ours.noop",
    ("ours", "sleep10ms"): "bench.ours.sleep10ms",
}


def _time_hooks() -> None:
    """Record the wall time of each celery-orphans per-task hook in Redis (``bench:hooks:<hook>``).

    Only for ``throughput.py --profile-hooks``: it wraps package internals by name and skips any that
    have moved, so a refactor makes the profile say less, never makes it fail.
    """
    import functools
    import importlib

    import redis
    from celery import signals

    conn = redis.Redis.from_url(os.environ["REDIS_URL"])

    def timed(label: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                conn.rpush(f"bench:hooks:{label}", time.perf_counter() - started)

        return wrapper

    request = importlib.import_module("celery_orphans.worker.request")
    mixin = getattr(request, "RecoverableRequestMixin", None)
    for attr, label in (
        ("_orphans_admit", "ledger write before the task (main process)"),
        ("_orphans_release", "ledger release at the ack (main process)"),
    ):
        if mixin is not None and callable(getattr(mixin, attr, None)):
            setattr(mixin, attr, timed(label, getattr(mixin, attr)))
    try:
        checkpoints = importlib.import_module("celery_orphans.worker.checkpoint")
    except ImportError:
        return
    receiver = getattr(checkpoints, "on_task_success", None)
    uid = "celery_orphans.task_success"
    if receiver is not None and signals.task_success.disconnect(dispatch_uid=uid):
        label = "checkpoint discard on success (pool child)"
        signals.task_success.connect(timed(label, receiver), dispatch_uid=uid, weak=False)


if os.environ.get("BENCH_TIME_HOOKS"):
    _time_hooks()
