"""``manage.py reconcile_orphan_tasks``: run one reconcile sweep now, or report what it would do."""

from __future__ import annotations

import json
import math
from argparse import ArgumentParser, ArgumentTypeError
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from celery_orphans import operations
from celery_orphans.answers import Answer, Result
from celery_orphans.choices import Trigger

MAX_GRACE_MINUTES = 60 * 24 * 365  # a year: longer than any task, short enough for a date
SWITCHED_OFF_HINT = ". Use --dry-run to see what a sweep would do, or switch it on."


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
            help="Only judge tasks started at least this long ago (fractions allowed), even those whose "
            "worker is known dead. Default: CELERY_ORPHANS_GRACE_SECONDS, which a task whose worker is known "
            "dead does not wait for.",
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
        grace = options["grace_minutes"]
        try:
            answer = operations.sweep(
                Trigger.COMMAND,
                operations.shell_user(),
                dry_run=options["dry_run"],
                grace_seconds=None if grace is None else grace * 60,
                max_attempts=options["max_attempts"],
            )
        except operations.Refused as exc:
            hint = SWITCHED_OFF_HINT if exc.problem is operations.Problem.SWITCHED_OFF else ""
            raise CommandError(f"{exc}{hint}") from exc
        self._print(answer, options)
        if answer.error is not None:
            raise CommandError(f"the sweep stopped part way: {answer.error}")

    def _print(self, answer: Answer, options: dict[str, Any]) -> None:
        results = answer.shown(every=options["all"])
        if options["json"]:
            for result in results:
                self.stdout.write(json.dumps(result.as_json()))
            return
        if results:
            self.stdout.write(_table(results))
        self.stdout.write(("Dry run: " if answer.dry_run else "") + answer.summary)


def _table(results: list[Result]) -> str:
    columns = ("task_id", "task_name", "worker", "action", "reason", "evidence")
    header = tuple(c.replace("_", " ").upper() for c in columns)
    lines = [tuple(str(r.as_json()[c]) for c in columns) for r in results]
    widths = [max(len(str(r[i])) for r in [header, *lines]) for i in range(len(header))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *lines])
