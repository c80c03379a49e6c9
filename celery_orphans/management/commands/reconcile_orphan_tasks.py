"""``manage.py reconcile_orphan_tasks``: run one reconcile sweep now, or report what it would do."""

from __future__ import annotations

import json
import math
from argparse import ArgumentParser, ArgumentTypeError
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError
from django.db import DatabaseError
from kombu.exceptions import KombuError

from celery_orphans import sweep
from celery_orphans.choices import Trigger
from celery_orphans.conf import settings
from celery_orphans.exceptions import LedgerUnavailable, SweepLocked
from celery_orphans.reconcile import Action

MAX_GRACE_MINUTES = 60 * 24 * 365  # a year: longer than any task, short enough for a date


def _non_negative_minutes(value: str) -> float:
    try:
        minutes = float(value)
    except ValueError:
        raise ArgumentTypeError(f"{value!r} is not a number of minutes") from None
    if not math.isfinite(minutes) or not 0 <= minutes <= MAX_GRACE_MINUTES:
        raise ArgumentTypeError(f"grace must be between 0 and {MAX_GRACE_MINUTES} minutes, got {value!r}")
    return minutes


def _positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise ArgumentTypeError(f"{value!r} is not a whole number") from None
    if number < 1:
        raise ArgumentTypeError(f"must be at least 1, got {value!r}")
    return number


class Command(BaseCommand):
    help = (
        "Find tasks whose worker died: send the @recoverable ones again with the same id, mark the rest "
        "terminal. Exits 0 when the sweep ran, 1 when it could not (lock held, Redis, database or broker "
        "unreachable, stopped part way)."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument(
            "--dry-run",
            action="store_true",
            help="Decide and report, change nothing. Works with CELERY_ORPHANS_ENABLED off.",
        )
        parser.add_argument(
            "--grace-minutes",
            type=_non_negative_minutes,
            default=None,
            help="Only judge tasks started at least this long ago (fractions allowed). "
            "Default: CELERY_ORPHANS_GRACE_SECONDS.",
        )
        parser.add_argument(
            "--max-attempts",
            type=_positive_int,
            default=None,
            help="Recoveries allowed per task before it is marked terminal, unless the task sets its own "
            "with @recoverable(max_attempts=...). Default: CELERY_ORPHANS_MAX_ATTEMPTS.",
        )
        parser.add_argument("--json", action="store_true", help="Print one JSON object per task.")
        parser.add_argument(
            "--all", action="store_true", help="List alive and in-grace tasks too, not only orphans."
        )

    def handle(self, *args: Any, **options: Any) -> None:
        dry_run: bool = options["dry_run"]
        try:
            if not dry_run and not settings.ENABLED:
                raise CommandError(
                    "CELERY_ORPHANS_ENABLED is off: nothing was changed. Use --dry-run to see what a sweep "
                    "would do, or switch it on."
                )
            grace = options["grace_minutes"]
            report = sweep.run(
                sweep.Options(
                    trigger=Trigger.COMMAND,
                    dry_run=dry_run,
                    grace_seconds=None if grace is None else grace * 60,
                    max_attempts=options["max_attempts"],
                )
            )
        except sweep.SweepFailed as exc:
            self._print(exc.report, options)
            raise CommandError(f"the sweep stopped part way: {exc}") from exc
        except SweepLocked as exc:
            raise CommandError(f"{exc}; nothing was done") from exc
        except (LedgerUnavailable, ImproperlyConfigured, DatabaseError) as exc:
            raise CommandError(str(exc)) from exc
        except (KombuError, OSError) as exc:
            raise CommandError(f"cannot reach the broker to ask the workers: {exc}") from exc
        self._print(report, options)

    def _print(self, report: sweep.Report, options: dict[str, Any]) -> None:
        outcomes = [o for o in report.outcomes if options["all"] or o.decision.action is not Action.LEAVE]
        if options["json"]:
            for o in outcomes:
                self.stdout.write(json.dumps(o.as_json()))
            return
        if outcomes:
            self.stdout.write(_table(outcomes))
        self.stdout.write(("Dry run: " if report.dry_run else "") + report.summary())


def _table(outcomes: list[sweep.Outcome]) -> str:
    columns = ("task_id", "task_name", "worker", "action", "reason", "evidence")
    header = tuple(c.replace("_", " ").upper() for c in columns)
    lines = [tuple(str(o.as_json()[c]) for c in columns) for o in outcomes]
    widths = [max(len(str(r[i])) for r in [header, *lines]) for i in range(len(header))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *lines])
