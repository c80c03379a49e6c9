"""The operators' surface: every running task's verdict, acting on chosen tasks, and the JSON endpoints.

The admin's in-flight view and the endpoints share ``in_flight`` and ``act``, so a person and a script
see the same verdicts (one dry run of the sweep's own decision code) and get the same refusals.

Endpoints, mounted with ``path("orphans/", include("celery_orphans.urls"))``:

``GET status/``
    For health checks and dashboards: in-flight tasks counted by verdict, the orphans among them by
    verdict, how many worker boots hold a lease, and the latest audit-log entry as ``last_action``.
    ``last_sweep`` is the last sweep that was not a dry run (``at``, ``trigger``, ``ok``, ``summary``,
    ``error``), or ``null`` before the first. 503 when Redis or the broker cannot be reached.
``POST sweep/``
    An empty body or ``{}`` runs one sweep now; ``{"task_ids": ["...", ...]}`` recovers only those tasks,
    at once (no grace), refusing live ones and never marking any terminal, with one result per id. 400
    for a body that is not that; 409 while another sweep runs or with ``CELERY_ORPHANS_ENABLED`` off;
    503 without Redis, or when carrying out an action failed (the body says which).

Both read ``request.user``, so whatever authentication the project runs (sessions, or a middleware that
sets the user from a token) applies: 401 without a user, 403 without the permission
``celery_orphans.recover_orphans``. The POST is CSRF-protected and limited per user to ``RATE_LIMIT``
(5 requests in 60 seconds, counted in Redis before the body is read): 429 with ``Retry-After`` beyond it.
Every action is written to the audit log with the trigger ``api`` and the user's name.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from datetime import datetime
from datetime import timezone as dt_timezone
from typing import Any

import redis
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.csrf import csrf_protect
from django_celery_results.models import TaskResult
from kombu.exceptions import KombuError

from celery_orphans import leases, ratelimit, sweep
from celery_orphans.conf import settings
from celery_orphans.exceptions import CeleryOrphansError, SweepLocked
from celery_orphans.ledger import Entry, Ledger
from celery_orphans.models import OrphanEvent, Trigger
from celery_orphans.reconcile import Action, Decision, Reason
from celery_orphans.store import Keys, client

logger = logging.getLogger(__name__)

PERMISSION = "celery_orphans.recover_orphans"
RATE_LIMIT = ratelimit.Limit(hits=5, seconds=60)
MAX_TASK_IDS = 1000
MAX_TASK_ID_LENGTH = 255  # TaskResult.task_id
# What a sweep raises when a service it needs is down or busy: shown to the operator, never a 500.
SWEEP_ERRORS = (CeleryOrphansError, KombuError, OSError)


class SwitchedOff(CeleryOrphansError):
    """``CELERY_ORPHANS_ENABLED`` is off: nothing is changed, as with the management command."""


class Verdict(str, enum.Enum):
    ALIVE = "alive"
    IN_GRACE = "in_grace"
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

    outcome: sweep.Outcome
    verdict: Verdict
    label: str
    started_at: datetime | None
    beat_age: float | None  # seconds since its worker boot last renewed its lease; None: none on record

    @property
    def beat_age_text(self) -> str:
        return "no heartbeat on record" if self.beat_age is None else _ago(self.beat_age)

    @property
    def started_text(self) -> str:
        if self.started_at is None:
            return "—"
        return _ago((datetime.now(tz=dt_timezone.utc) - self.started_at).total_seconds())


def _ago(seconds: float) -> str:
    whole = max(0, round(seconds))
    if whole < 120:
        return f"{whole} s ago"
    return f"{whole // 60} min ago" if whole < 7200 else f"{whole // 3600} h ago"


def in_flight(trigger: Trigger) -> list[InFlight]:
    """Every running task with its verdict, from one dry run; raises what ``sweep.run`` raises."""
    report = sweep.run(sweep.Options(trigger=trigger, dry_run=True))
    ids = [o.decision.task_id for o in report.outcomes]
    entries = _entries(ids)
    started = dict(
        TaskResult.objects.filter(task_id__in=ids, date_started__isnull=False).values_list(
            "task_id", "date_started"
        )
    )
    ages = _beat_ages(report.outcomes, entries)
    rows = []
    for o in report.outcomes:
        task_id = o.decision.task_id
        entry = entries.get(task_id)
        begun = started.get(task_id) or (
            datetime.fromtimestamp(entry.recorded_at, tz=dt_timezone.utc) if entry else None
        )
        rows.append(InFlight(o, *verdict(o.decision), started_at=begun, beat_age=ages.get(task_id)))
    return rows


def _entries(task_ids: list[str]) -> dict[str, Entry]:
    try:
        loaded = Ledger(client(), Keys.current()).load(task_ids) if task_ids else {}
    except redis.RedisError as exc:
        logger.warning("celery-orphans: could not read %d ledger entries: %s", len(task_ids), exc)
        return {}
    return {task_id: e for task_id, e in loaded.items() if isinstance(e, Entry)}


def _beat_ages(outcomes: Iterable[sweep.Outcome], entries: dict[str, Entry]) -> dict[str, float]:
    """Seconds since each task's owner last beat: its boot's, or the node's newest one without an entry."""
    owners: dict[str, list[tuple[str, str]]] = {}
    try:
        conn, keys = client(), Keys.current()
        orphans = sorted({o.worker for o in outcomes if o.worker and o.decision.task_id not in entries})
        pipe = conn.pipeline(transaction=False)
        for node in orphans:
            pipe.hkeys(keys.boots(node))
        boots = {node: [b.decode() for b in found] for node, found in zip(orphans, pipe.execute())}
        for o in outcomes:
            entry = entries.get(o.decision.task_id)
            owners[o.decision.task_id] = (
                [(entry.node, entry.boot)] if entry else [(o.worker, b) for b in boots.get(o.worker, [])]
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


def sweep_all(trigger: Trigger, user: str) -> sweep.Report:
    """One whole sweep now, as Beat would run it, audited under ``user``."""
    _require_enabled()
    return sweep.run(sweep.Options(trigger=trigger, user=user))


def act(task_ids: Collection[str], *, mark_terminal: bool, trigger: Trigger, user: str) -> list[Result]:
    """Recover (or mark terminal) the chosen tasks now, refusing live ones; one result per task id."""
    _require_enabled()
    wanted = Action.MARK_TERMINAL if mark_terminal else Action.RECOVER
    options = sweep.Options(
        trigger=trigger,
        user=user,
        grace_seconds=0,  # the operator has looked; the worker's answer still protects live tasks
        task_ids=frozenset(task_ids),
        acts=frozenset({wanted}),
        mark_terminal=mark_terminal,
    )
    try:
        report = sweep.run(options)
    except sweep.SweepFailed as exc:
        report = exc.report
    results, stopped = [], False
    for o in report.outcomes:
        results.append(_result(o, wanted, shadow=report.shadow, stopped=stopped))
        stopped = stopped or o.error is not None
    missing = sorted(set(task_ids) - {o.decision.task_id for o in report.outcomes})
    gone = "no running task has this id (it ended or never ran)"
    results += [Result(t, "", "", "not_found", "refused", f"{t}: {gone}.") for t in missing]
    return results


def _result(o: sweep.Outcome, wanted: Action, *, shadow: bool, stopped: bool) -> Result:
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


# The JSON endpoints.

View = Callable[[HttpRequest], HttpResponse]


def _error(status: int, message: str, **extra: Any) -> JsonResponse:
    return JsonResponse({"error": message, **extra}, status=status)


def _endpoint(method: str) -> Callable[[View], View]:
    """Allow one method, to a user with the permission; answer JSON for every refusal."""

    def decorate(view: View) -> View:
        @functools.wraps(view)
        def wrapper(request: HttpRequest) -> HttpResponse:
            if not request.user.is_authenticated:
                return _error(401, "authentication required")
            if not request.user.has_perm(PERMISSION):
                return _error(403, f"the permission {PERMISSION} is required")
            if request.method != method:
                response = _error(405, f"use {method}")
                response["Allow"] = method
                return response
            return view(request)

        return never_cache(wrapper)

    return decorate


@_endpoint("GET")
def status(request: HttpRequest) -> HttpResponse:
    """Counts for health checks and dashboards; see the module docstring."""
    try:
        rows = in_flight(Trigger.API)
        lease_count = leases.count()
    except (*SWEEP_ERRORS, redis.RedisError) as exc:
        return _error(503, str(exc))
    by_verdict = Counter(r.verdict.value for r in rows)
    orphans = Counter(r.verdict.value for r in rows if r.outcome.decision.orphaned)
    last = (
        OrphanEvent.objects.values("created_at", "action", "task_id", "task_name", "trigger", "triggered_by")
        .order_by("-created_at", "-id")
        .first()
    )
    return JsonResponse(
        {
            "enabled": settings.ENABLED,
            "shadow_mode": settings.SHADOW_MODE,
            "in_flight": {"total": len(rows), **{v.value: by_verdict[v.value] for v in Verdict}},
            "orphans": {"total": sum(orphans.values()), **{v.value: orphans[v.value] for v in Verdict}},
            "leases": lease_count,
            "last_sweep": sweep.last_sweep(),
            "last_action": last,
        }
    )


@_endpoint("POST")
@csrf_protect
def sweep_now(request: HttpRequest) -> HttpResponse:
    """Run a sweep, or recover the given task ids; see the module docstring."""
    try:
        wait = ratelimit.hit(f"api:{request.user.pk}", RATE_LIMIT)
    except redis.RedisError as exc:
        return _error(503, f"cannot reach Redis: {exc}")
    if wait:
        limit = f"at most {RATE_LIMIT.hits} requests in {RATE_LIMIT.seconds} s"
        response = _error(429, limit, retry_after=wait)
        response["Retry-After"] = str(wait)
        return response
    try:
        task_ids = _requested_ids(request.body)
    except ValueError as exc:
        return _error(400, str(exc))
    user = request.user.get_username()
    try:
        if task_ids is None:
            return _swept(sweep_all(Trigger.API, user))
        results = act(task_ids, mark_terminal=False, trigger=Trigger.API, user=user)
    except sweep.SweepFailed as exc:
        return _swept(exc.report, error=str(exc))
    except (SweepLocked, SwitchedOff) as exc:
        return _error(409, str(exc))
    except SWEEP_ERRORS as exc:
        return _error(503, str(exc))
    failed = any(r.level == "failed" for r in results)
    return JsonResponse({"results": [dataclasses.asdict(r) for r in results]}, status=503 if failed else 200)


def _requested_ids(body: bytes) -> frozenset[str] | None:
    """The ids in the body, or ``None`` for a whole sweep; ``ValueError`` for anything else."""
    if not body.strip():
        return None
    try:
        data = json.loads(body)
    except ValueError:
        raise ValueError("the body must be JSON") from None
    if not isinstance(data, dict):
        raise ValueError('the body must be a JSON object: {} or {"task_ids": [...]}')
    unknown = sorted(set(data) - {"task_ids"})
    if unknown:
        raise ValueError(f"unknown fields: {', '.join(unknown)}")
    return clean_task_ids(data["task_ids"]) if "task_ids" in data else None


def _swept(report: sweep.Report, error: str | None = None) -> JsonResponse:
    outcomes = [
        {
            "task_id": o.decision.task_id,
            "task_name": o.task_name,
            "worker": o.worker,
            "action": o.decision.action.value,
            "reason": o.decision.reason.value,
            "evidence": o.decision.evidence.value,
            "detail": o.decision.detail,
            "attempt": o.decision.attempt,
            "done": o.done,
            "error": o.error,
        }
        for o in report.outcomes
        if o.decision.action is not Action.LEAVE
    ]
    body = {"summary": report.summary(), "shadow": report.shadow, "outcomes": outcomes}
    return JsonResponse({**body, "error": error}, status=503) if error else JsonResponse(body)
