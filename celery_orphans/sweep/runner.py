"""One sweep: gather what is running, let ``rules.decide`` judge it, carry the decisions out."""

from __future__ import annotations

import contextlib
import gc
import json
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import redis
from celery import Celery, current_app
from django.utils import timezone

from celery_orphans import leases, logs, metrics, registry
from celery_orphans.conf import settings
from celery_orphans.decision import Action, Reason
from celery_orphans.entry import Entry
from celery_orphans.exceptions import LedgerUnavailable
from celery_orphans.ledger import Ledger
from celery_orphans.observations import Candidate, WorkerView
from celery_orphans.recovery.executor import ACTS, Executor
from celery_orphans.recovery.outcome import Outcome
from celery_orphans.rules import Limits, asks_about, by_operator, decide, defer_excess
from celery_orphans.store import Keys, client
from celery_orphans.sweep import liveness
from celery_orphans.sweep.candidates import ended_since, find, merge, own_tasks
from celery_orphans.sweep.lock import sweep_lock
from celery_orphans.sweep.values import Options, Report, SweepFailed

logger = logs.get(__name__)


def run(options: Options, app: Celery | None = None) -> Report:
    """Run one sweep; ``SweepLocked`` if another holds the lock, ``LedgerUnavailable`` without Redis."""
    app = app or current_app
    started = time.monotonic()
    executor: Executor | None = None
    if options.dry_run:
        report = _judge(app, options).report
    else:
        try:
            with sweep_lock():
                judged = _judge(app, options)
                executor = Executor(app, judged.ledger, options.trigger, judged.now, options.user)
                report = _act(executor, options, judged)
        finally:
            if executor is not None:
                executor.claims.lift_unsettled()  # only if the transaction did not commit
                executor.close()
    report.duration = time.monotonic() - started
    if metrics.enabled():
        metrics.swept(report.duration, _count_leases())
    # A sweep that found nothing to act on (every task alive or in grace), as most do, is no news; nor
    # is a shadow sweep that finds the orphans an earlier one recorded, nor one that finds again the
    # records it can only report (each is audited the first time: that sweep is news).
    acted = any(o.decision.action not in (Action.LEAVE, Action.REPORT) for o in report.outcomes)
    if report.shadow and executor is not None:
        acted = executor.shadowed > 0
    if executor is not None and executor.reported:
        acted = True
    noteworthy = acted or any(o.error for o in report.outcomes)
    (logger.info if noteworthy else logger.debug)("%s", report.summary())
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
    with logs.redis_fault_let_go(logger, "could not record the last sweep"):
        client().hset(Keys.current().last_sweep, mapping=record)


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


@dataclass(frozen=True)
class Judged:
    """What a sweep found and decided, before it acts: the report, and what acting on it needs."""

    report: Report
    candidates: list[Candidate]
    entries: dict[str, Entry]
    ledger: Ledger
    now: datetime


def _judge(app: Celery, options: Options) -> Judged:
    """Gather what is running and decide about each task; nothing is changed."""
    registry.load_tasks(app)
    now = timezone.now()
    grace = timedelta(
        seconds=settings.GRACE_SECONDS if options.grace_seconds is None else options.grace_seconds
    )
    max_age = settings.MAX_ORPHAN_AGE_SECONDS
    limits = Limits(
        now=now,
        grace=grace,
        max_attempts=options.max_attempts or settings.MAX_ATTEMPTS,
        groups=settings.GROUPS,
        max_age=None if max_age is None else timedelta(seconds=max_age),
        min_age=timedelta(0) if options.grace_seconds is None else grace,
    )
    ledger = Ledger(client(), Keys.current())
    with _collector_paused():
        try:
            if options.boot is None:
                candidates, entries, views = _gather_and_ask(app, ledger, now, grace, options)
            else:
                candidates, entries, views = own_tasks(app, ledger, options.boot)
        except redis.RedisError as exc:
            raise LedgerUnavailable(f"cannot reach Redis for the ledger and leases: {exc}") from exc
        candidates.sort(key=lambda c: (c.started_at or now, c.task_id))
        decisions = [decide(c, views.get(c.worker) if c.worker else None, limits) for c in candidates]
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
    return Judged(report, candidates, entries, ledger, now)


def _act(executor: Executor, options: Options, judged: Judged) -> Report:
    """Carry the decisions out, in order, stopping at the first that fails."""
    report, candidates, entries = judged.report, judged.candidates, judged.entries
    outcomes = report.outcomes
    for i, (candidate, outcome) in enumerate(zip(candidates, outcomes)):
        action = outcome.decision.action
        if action is Action.REPORT and outcome.decision.reason is Reason.UNREADABLE:
            executor.report(outcome)
            continue
        if action not in ACTS or (options.acts is not None and action not in options.acts):
            continue
        if report.shadow:
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
    app: Celery, ledger: Ledger, now: datetime, grace: timedelta, options: Options
) -> tuple[list[Candidate], dict[str, Entry], dict[str, WorkerView]]:
    """Everything running, and a view of each worker running something: its leases, and its answer
    about the tasks only a result row knows of whose decision its answer can change
    (``rules.asks_about``: no other task needs one)."""
    candidates, entries = merge(app, ledger, find(ledger, None, options.task_ids))
    ask: dict[str, set[str]] = {}
    for c in candidates if options.ask_workers else ():
        if c.worker and asks_about(c, now, grace):
            ask.setdefault(c.worker, set()).add(c.task_id)
    nodes = {c.worker for c in candidates if c.worker}
    views = liveness.observe(app, nodes, ask, settings.INSPECT_TIMEOUT_SECONDS, ledger.client)
    # A task that ended with Ignore or Reject while its node was asked is not named in the answer: its
    # ending, written before the node let it go, is read again.
    asked = {task_id for ids in ask.values() for task_id in ids}
    return ended_since(ledger, candidates, asked), entries, views


def _count_leases() -> int | None:
    with logs.redis_fault_let_go(logger, "cannot count the leases for the metrics"):
        return leases.count()
    return None


def _forget_lapsed_boots(nodes: set[str]) -> None:
    # After the actions, which read the last heartbeat of the boots they judged.
    with logs.redis_fault_let_go(logger, "could not forget lapsed worker boots"):
        leases.fresh_boots(nodes, prune=True)
