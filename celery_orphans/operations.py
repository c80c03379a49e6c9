"""The operators' service: every running task's verdict, and acting on the tasks a person chose.

The admin's in-flight page and the HTTP endpoints (``views.py``) share it, so a person and a script see
the same verdicts (one dry run of the sweep's own decision code) and get the same refusals.
"""

from __future__ import annotations

import enum
import logging
import time
from collections import Counter
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import redis
from django.utils import timezone
from kombu.exceptions import KombuError

from celery_orphans import leases
from celery_orphans.choices import Trigger
from celery_orphans.conf import settings
from celery_orphans.exceptions import CeleryOrphansError
from celery_orphans.reconcile import Action, Decision, Evidence, Reason
from celery_orphans.store import Keys, client
from celery_orphans.sweep.runner import run
from celery_orphans.sweep.values import Options, Outcome, Report, SweepFailed

logger = logging.getLogger(__name__)

PERMISSION = "celery_orphans.recover_orphans"
MAX_TASK_IDS = 1000
MAX_TASK_ID_LENGTH = 255  # TaskResult.task_id
# What a sweep raises when a service it needs is down or busy: shown to the operator, never a 500.
SWEEP_ERRORS = (CeleryOrphansError, KombuError, OSError)


class SwitchedOff(CeleryOrphansError):
    """``CELERY_ORPHANS_ENABLED`` is off: nothing is changed, as with the management command."""


class Verdict(str, enum.Enum):
    ALIVE = "alive"
    IN_GRACE = "in_grace"
    HANDED_BACK = "handed_back"
    WILL_RECOVER = "will_recover"
    WILL_MARK_TERMINAL = "will_mark_terminal"
    NOT_RECOVERABLE = "not_recoverable"
    DEFERRED = "deferred"
    FINISHED = "finished"
    UNREADABLE = "unreadable"


def verdict(d: Decision) -> tuple[Verdict, str]:
    """The verdict on one running task, and how a person reads it."""
    if d.action is Action.LEAVE:
        if d.reason is Reason.IN_GRACE:
            return Verdict.IN_GRACE, "in grace"
        if d.reason is Reason.DEFERRED:
            return Verdict.DEFERRED, f"orphan (deferred: {d.detail})"
        if d.reason is Reason.HANDED_BACK:
            return Verdict.HANDED_BACK, "handed back to the broker"
        if d.reason is Reason.ALREADY_FINISHED:
            return Verdict.FINISHED, f"finished ({d.detail})"
        return Verdict.ALIVE, "alive"
    if d.action is Action.RECOVER:
        if d.reason is Reason.ALREADY_SENT:
            return Verdict.WILL_RECOVER, f"orphan (sent again as recovery {d.attempt}; not yet recorded)"
        return Verdict.WILL_RECOVER, "orphan (will be recovered)"
    if d.action is Action.MARK_TERMINAL:
        if d.reason is Reason.NOT_RECOVERABLE:
            return Verdict.NOT_RECOVERABLE, "not recoverable"
        return Verdict.WILL_MARK_TERMINAL, f"orphan (will be marked terminal: {d.detail})"
    if d.action is Action.FORGET:
        return Verdict.FINISHED, f"finished ({d.detail})"
    return Verdict.UNREADABLE, f"unreadable: {d.detail}"


@dataclass(frozen=True)
class InFlight:
    """One running task as the sweep would judge it now."""

    outcome: Outcome
    verdict: Verdict
    label: str
    beat_age: float | None  # seconds since its worker boot last renewed its lease; None: none on record

    @property
    def beat_age_text(self) -> str:
        return "no heartbeat on record" if self.beat_age is None else _ago(self.beat_age)

    @property
    def started_at(self) -> datetime | None:
        return self.outcome.started_at

    @property
    def started_text(self) -> str:
        if self.started_at is None:
            return "—"
        return _ago((timezone.now() - self.started_at).total_seconds())


def _ago(seconds: float) -> str:
    whole = max(0, round(seconds))
    if whole < 120:
        return f"{whole} s ago"
    return f"{whole // 60} min ago" if whole < 7200 else f"{whole // 3600} h ago"


def counted(decisions: Iterable[list[Any]]) -> tuple[dict[str, int], dict[str, int]]:
    """Tasks by verdict, and the orphans among them, from ``[action, reason, evidence, count]`` rows
    (as the last sweep recorded them)."""
    running: Counter[str] = Counter()
    orphans: Counter[str] = Counter()
    for action, reason, evidence, count in decisions:
        d = Decision("", Action(action), Reason(reason), Evidence(evidence))
        shown = verdict(d)[0].value
        running[shown] += count
        if d.orphaned:
            orphans[shown] += count
    every = [v.value for v in Verdict]
    return (
        {"total": sum(running.values()), **{v: running[v] for v in every}},
        {"total": sum(orphans.values()), **{v: orphans[v] for v in every}},
    )


def in_flight(trigger: Trigger) -> list[InFlight]:
    """Every running task with its verdict, from one dry run; raises what ``sweep.run`` raises."""
    report = run(Options(trigger=trigger, dry_run=True))
    ages = _beat_ages(report.outcomes)
    return [InFlight(o, *verdict(o.decision), beat_age=ages.get(o.decision.task_id)) for o in report.outcomes]


def _beat_ages(outcomes: Iterable[Outcome]) -> dict[str, float]:
    """Seconds since each task's owner last beat: its boot's, or the node's newest one without an entry."""
    owners: dict[str, list[tuple[str, str]]] = {}
    try:
        conn, keys = client(), Keys.current()
        nameless = sorted({o.worker for o in outcomes if o.worker and o.boot is None})
        pipe = conn.pipeline(transaction=False)
        for node in nameless:
            pipe.hkeys(keys.boots(node))
        boots = {node: [b.decode() for b in found] for node, found in zip(nameless, pipe.execute())}
        for o in outcomes:
            owners[o.decision.task_id] = (
                [(o.worker, o.boot)] if o.boot else [(o.worker, b) for b in boots.get(o.worker, [])]
            )
        beats = leases.last_beats({pair for pairs in owners.values() for pair in pairs}, conn)
    except redis.RedisError as exc:
        logger.warning("celery-orphans: could not read the workers' last heartbeats: %s", exc)
        return {}
    now = time.time()
    return {
        task_id: now - max(beats[p] for p in pairs if p in beats)
        for task_id, pairs in owners.items()
        if any(p in beats for p in pairs)
    }


@dataclass(frozen=True)
class Result:
    """What an operator's action did to one task."""

    task_id: str
    task_name: str
    worker: str
    status: str  # recovered, marked_terminal, would_..., not_found, failed, or the reason it was refused
    level: str  # done, refused or failed
    message: str


def clean_task_ids(value: object) -> frozenset[str]:
    """Task ids chosen by an operator; ``ValueError`` saying what is wrong with them."""
    if not isinstance(value, list) or not value:
        raise ValueError("task_ids must be a non-empty list of task id strings")
    if len(value) > MAX_TASK_IDS:
        raise ValueError(f"at most {MAX_TASK_IDS} task ids at a time, got {len(value)}")
    for task_id in value:
        if not isinstance(task_id, str) or not 0 < len(task_id) <= MAX_TASK_ID_LENGTH:
            raise ValueError(f"each task id must be a string of 1 to {MAX_TASK_ID_LENGTH} characters")
    return frozenset(value)


def _require_enabled() -> None:
    if not settings.ENABLED:
        raise SwitchedOff("CELERY_ORPHANS_ENABLED is off: nothing was changed")


def sweep_all(trigger: Trigger, user: str) -> Report:
    """One whole sweep now, as Beat would run it, audited under ``user``."""
    _require_enabled()
    return run(Options(trigger=trigger, user=user))


def act_on(task_ids: Collection[str], *, mark_terminal: bool, trigger: Trigger, user: str) -> list[Result]:
    """Recover (or mark terminal) the chosen tasks now, refusing live ones; one result per task id."""
    _require_enabled()
    wanted = Action.MARK_TERMINAL if mark_terminal else Action.RECOVER
    options = Options(
        trigger=trigger,
        user=user,
        grace_seconds=0,  # the operator has looked; the worker's answer still protects live tasks
        task_ids=frozenset(task_ids),
        acts=frozenset({wanted}),
        mark_terminal=mark_terminal,
    )
    try:
        report = run(options)
    except SweepFailed as exc:
        report = exc.report
    results, stopped = [], False
    for o in report.outcomes:
        results.append(_result(o, wanted, shadow=report.shadow, stopped=stopped))
        stopped = stopped or o.error is not None
    missing = sorted(set(task_ids) - {o.decision.task_id for o in report.outcomes})
    gone = "no running task has this id (it ended or never ran)"
    results += [Result(t, "", "", "not_found", "refused", f"{t}: {gone}.") for t in missing]
    return results


def _result(o: Outcome, wanted: Action, *, shadow: bool, stopped: bool) -> Result:
    d = o.decision
    ref = f"{o.task_name or '?'}[{d.task_id}]"
    verb = "recover" if wanted is Action.RECOVER else "mark terminal"

    def result(status: str, level: str, message: str) -> Result:
        return Result(d.task_id, o.task_name, o.worker, status, level, message)

    if o.error is not None:
        return result("failed", "failed", f"Could not {verb} {ref}: {o.error}. Nothing after it was tried.")
    if d.action is wanted and o.done and shadow:
        would = "be recovered" if wanted is Action.RECOVER else "be marked terminal"
        return result(
            f"would_{wanted.value}", "done", f"Shadow mode: only recorded that {ref} would {would}."
        )
    if d.action is Action.RECOVER and o.done:
        return result("recovered", "done", f"Recovered {ref} (attempt {d.attempt}): sent again.")
    if d.action is Action.MARK_TERMINAL and o.done:
        return result("marked_terminal", "done", f"Marked {ref} terminal: its result is now FAILURE.")
    if d.action is wanted:
        if stopped:
            return result("not_attempted", "failed", f"Did not {verb} {ref}: an earlier task failed.")
        return result("changed", "refused", f"Left {ref}: it changed while being checked; look again.")
    if d.reason is Reason.ALIVE:
        why = f"worker {o.worker} is alive and still has it ({d.evidence.value.replace('_', ' ')})"
    elif d.reason is Reason.NOT_RECOVERABLE:
        why = f"{o.task_name} is not marked @recoverable, so it is never sent again"
    elif d.reason is Reason.IN_GRACE:
        why = "it started too recently to judge"
    else:
        why = d.detail or d.reason.value.replace("_", " ")
    left = "; it was left as it is (close it with the admin's “Mark terminal”)"
    left = left if d.action is Action.MARK_TERMINAL else ""
    return result(d.reason.value, "refused", f"Refused to {verb} {ref}: {why}{left}.")
