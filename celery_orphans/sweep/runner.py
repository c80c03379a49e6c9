"""One sweep: gather what is running, let ``reconcile.decide`` judge it, carry the decisions out."""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import time
from collections import Counter
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import redis
from celery import Celery, current_app
from django.utils import timezone

from celery_orphans import leases, metrics, registry
from celery_orphans.conf import settings
from celery_orphans.entry import Entry
from celery_orphans.exceptions import LedgerUnavailable
from celery_orphans.ledger import Ledger
from celery_orphans.reconcile import (
    Action,
    Candidate,
    Policy,
    WorkerView,
    by_operator,
    decide,
    defer_excess,
)
from celery_orphans.store import Keys, client
from celery_orphans.sweep import actions, liveness
from celery_orphans.sweep.candidates import find, merge, own_tasks
from celery_orphans.sweep.lock import sweep_lock
from celery_orphans.sweep.values import Options, Outcome, Report, SweepFailed

logger = logging.getLogger(__name__)


def run(options: Options, app: Celery | None = None) -> Report:
    """Run one sweep; ``SweepLocked`` if another holds the lock, ``LedgerUnavailable`` without Redis."""
    app = app or current_app
    started = time.monotonic()
    executors: list[actions.Executor] = []
    if options.dry_run:
        report = _sweep(app, options, executors)
    else:
        try:
            with sweep_lock():
                report = _sweep(app, options, executors)
        finally:
            for executor in executors:
                executor.lift_unsettled()  # only if the transaction did not commit
                executor.close()
    report.duration = time.monotonic() - started
    metrics.swept(report.duration)
    # A sweep that found nothing to act on (every task alive or in grace), as most do, is no news.
    noteworthy = any(o.decision.action is not Action.LEAVE or o.error for o in report.outcomes)
    (logger.info if noteworthy else logger.debug)("celery-orphans: %s", report.summary())
    failure = next((o for o in report.outcomes if o.error), None)
    if not options.dry_run and options.boot is None and options.task_ids is None:
        _remember(options, report, failure)
    if failure is not None:
        raise SweepFailed(
            f"stopped at {failure.task_name}[{failure.decision.task_id}]: {failure.error}", report
        )
    return report


def _remember(options: Options, report: Report, failure: Outcome | None) -> None:
    """Keep the last whole sweep's time, outcome and decisions for status pages (one small Redis hash)."""
    decided = Counter((o.decision.action, o.decision.reason, o.decision.evidence) for o in report.outcomes)
    record: dict[str | bytes, bytes | float | int | str] = {
        "at": timezone.now().isoformat(),
        "trigger": str(options.trigger),
        "ok": "false" if failure else "true",
        "summary": report.summary(),
        "error": failure.error or "" if failure else "",
        "decisions": json.dumps([[a.value, r.value, e.value, n] for (a, r, e), n in sorted(decided.items())]),
    }
    try:
        client().hset(Keys.current().last_sweep, mapping=record)
    except redis.RedisError as exc:
        logger.warning("celery-orphans: could not record the last sweep: %s", exc)


def last_sweep() -> dict[str, Any] | None:
    """The last whole sweep that was not a dry run: when and how long ago, what ran it, whether it
    finished, its summary line, and its decisions as ``[action, reason, evidence, count]``."""
    found = client().hgetall(Keys.current().last_sweep)
    if not found:
        return None
    data: dict[str, Any] = {k.decode(): v.decode() for k, v in found.items()}
    data["ok"] = data.get("ok") == "true"
    data["decisions"] = json.loads(data.get("decisions") or "[]")
    try:
        data["age_seconds"] = round((timezone.now() - datetime.fromisoformat(data["at"])).total_seconds(), 3)
    except (KeyError, TypeError, ValueError):
        data["age_seconds"] = None
    return data


def _sweep(app: Celery, options: Options, executors: list[actions.Executor]) -> Report:
    registry.load_tasks(app)
    now = timezone.now()
    grace = timedelta(
        seconds=settings.GRACE_SECONDS if options.grace_seconds is None else options.grace_seconds
    )
    max_age = settings.MAX_ORPHAN_AGE_SECONDS
    policy = Policy(
        now=now,
        grace=grace,
        max_attempts=options.max_attempts or settings.MAX_ATTEMPTS,
        groups=settings.GROUPS,
        max_age=None if max_age is None else timedelta(seconds=max_age),
    )
    ledger = Ledger(client(), Keys.current())
    with _collector_paused():
        try:
            if options.boot is None:
                candidates, entries, views = _gather_and_ask(app, ledger, now, grace, options.task_ids)
            else:
                candidates, entries, views = own_tasks(app, ledger, options.boot)
        except redis.RedisError as exc:
            raise LedgerUnavailable(f"cannot reach Redis for the ledger and leases: {exc}") from exc
        candidates.sort(key=lambda c: (c.started_at or now, c.task_id))
        decisions = [decide(c, views.get(c.worker) if c.worker else None, policy) for c in candidates]
        if options.mark_terminal:
            decisions = [by_operator(d) for d in decisions]
        # Only recoveries are limited per sweep: an operator closing orphans closes every one chosen.
        decisions = defer_excess(decisions, settings.MAX_RECOVERIES_PER_SWEEP)
        outcomes = [
            Outcome(d, c.task_name or "", c.worker or "", started_at=c.started_at, boot=c.boot)
            for c, d in zip(candidates, decisions)
        ]
    shadow = options.shadow if options.shadow is not None else settings.SHADOW_MODE
    report = Report(outcomes, dry_run=options.dry_run, shadow=shadow)
    if options.dry_run:
        return report
    executor = actions.Executor(app, ledger, options.trigger, now, options.user)
    executors.append(executor)
    for i, (candidate, outcome) in enumerate(zip(candidates, outcomes)):
        action = outcome.decision.action
        if action not in actions.ACTS or (options.acts is not None and action not in options.acts):
            continue
        if shadow:
            outcome = executor.shadow(outcome)
        else:
            outcome = executor.carry_out(outcome, candidate, entries.get(candidate.task_id))
        outcomes[i] = outcome
        if outcome.error is not None:
            return report  # stopped there: the rest is found again by the next sweep
    _forget_lapsed_boots({c.worker for c in candidates if c.worker})
    return report


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Hold Python's cyclic garbage collector off while the sweep gathers and decides.

    Over thousands of tasks that allocates hundreds of thousands of objects, which reference counting
    frees, but which set off collections all the same, full ones among them that walk every object in
    the process: a tenth of a second and more, in a dry run that otherwise takes little more than the
    broadcast's wait. Any cyclic garbage made meanwhile is collected once the collector runs again.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _gather_and_ask(
    app: Celery, ledger: Ledger, now: datetime, grace: timedelta, only: frozenset[str] | None
) -> tuple[list[Candidate], dict[str, Entry], dict[str, WorkerView]]:
    """Everything running, and a view of each worker running something: its leases, and its answer
    about the tasks only a result row knows of, past their grace (no other task needs one)."""
    candidates, entries = merge(app, ledger, find(ledger, None, only))
    ask: dict[str, set[str]] = {}
    for c in candidates:
        past_grace = c.started_at is None or c.started_at <= now - grace
        if c.worker and c.boot is None and past_grace and not c.problem:
            ask.setdefault(c.worker, set()).add(c.task_id)
    nodes = {c.worker for c in candidates if c.worker}
    views = liveness.observe(app, nodes, ask, settings.INSPECT_TIMEOUT_SECONDS, ledger.client)
    return candidates, entries, views


def _forget_lapsed_boots(nodes: set[str]) -> None:
    # After the actions, which read the last beat of the boots they judged.
    try:
        leases.fresh_boots(nodes, prune=True)
    except redis.RedisError as exc:
        logger.warning("celery-orphans: could not forget lapsed worker boots: %s", exc)
