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

ROOT = Path(__file__).resolve().parent.parent
for path in (str(ROOT), str(ROOT / "testproject")):
    if path not in sys.path:
        sys.path.insert(0, path)
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "testproject.settings")
os.environ.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/bench_orphans")
os.environ.setdefault("REDIS_URL", "redis://127.0.0.1:6379/13")

import django  # noqa: E402

django.setup()

from celery import Celery  # noqa: E402

from celery_orphans import recoverable  # noqa: E402

app = Celery("throughput")
app.config_from_object("django.conf:settings", namespace="CELERY")

SLEEP_SECONDS = 0.01


def _noop() -> None:
    return None


def _sleep() -> None:
    time.sleep(SLEEP_SECONDS)


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
