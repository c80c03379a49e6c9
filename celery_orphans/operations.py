"""The operators' service: the one room behind three doors, the admin, the HTTP API and the command.

Each door asks here (a sweep now, a dry run of one, the running tasks' verdicts, the status, acting on
the tasks a person chose) and gets the same answers: one ``Result`` per task, with one JSON shape and
one ``Status`` vocabulary, and one error mapping, ``Refused`` (``refusals.py``): a lock held elsewhere,
the master switch off, Redis, the database or the broker out of reach, a configuration that cannot
work. Each is a sentence with its cause, never a traceback or a 500, and never a library's text with a
password in it.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import socket
import time
from collections.abc import Collection, Iterable, Iterator
from typing import Any

from celery import current_app
from django.apps import apps

from celery_orphans import answers, inflight, leases, logs, ratelimit
from celery_orphans.answers import Answer, Result, Status
from celery_orphans.choices import AuditAction, Trigger
from celery_orphans.conf import settings
from celery_orphans.decision import Action
from celery_orphans.ledger import ledger_for
from celery_orphans.recovery import audit, lift
from celery_orphans.recovery.outcome import Outcome
from celery_orphans.refusals import Problem as Problem
from celery_orphans.refusals import Refused as Refused
from celery_orphans.refusals import cause as cause
from celery_orphans.refusals import mapped
from celery_orphans.store import Keys, client
from celery_orphans.sweep.runner import last_sweep, run
from celery_orphans.sweep.values import Options, Report, SweepFailed
from celery_orphans.verdicts import counted

logger = logs.get(__name__)

PERMISSION = "celery_orphans.recover_orphans"
LIFT_PERMISSION = "celery_orphans.lift_recovery_cap"  # lift a task's recovery cap: it is sent once more
STATUS_PERMISSION = "celery_orphans.view_status"  # status/ only: for dashboards and probes
MAX_TASK_IDS = 1000
MAX_TASK_ID_LENGTH = 255  # TaskResult.task_id
# What one user may ask for in a sliding minute, through the admin and the HTTP API together: actions,
# sweeps and in-flight loads that ask the workers.
RATE_LIMIT = ratelimit.Limit(hits=5, seconds=60)
RATE_LIMITED = "rate_limited"  # the reason an audit row gives for a request over the limit


def _require_enabled() -> None:
    if not settings.ENABLED:
        raise Refused(Problem.SWITCHED_OFF, "CELERY_ORPHANS_ENABLED is off: nothing was changed")


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


def shell_user() -> str:
    """Who runs a command from a shell or cron, as the audit log names them: the operating system's user
    and host (``deploy@web-1``), as the admin and the API name their logged-in user."""
    try:
        name = getpass.getuser()
    except (KeyError, OSError):  # no login name in the environment, and a uid without a passwd entry
        name = f"uid {os.getuid()}" if hasattr(os, "getuid") else "unknown user"
    return f"{name}@{socket.gethostname()}"[:150]


def sweep(
    trigger: Trigger,
    user: str = "",
    *,
    dry_run: bool = False,
    grace_seconds: float | None = None,
    max_attempts: int | None = None,
) -> Answer:
    """One whole sweep now, as Beat would run it, audited under ``user``; a dry run changes nothing.

    A sweep that is refused, or that finds nothing to do, is audited too (not a dry run)."""
    options = Options(
        trigger=trigger, dry_run=dry_run, grace_seconds=grace_seconds, max_attempts=max_attempts, user=user
    )
    with _refusals_audited(trigger, user, audited=not dry_run):
        if not dry_run:
            _require_enabled()
        report, error = _run(options)
    if not dry_run and error is None and not any(o.done for o in report.outcomes):
        summary = report.summary()
        audit.record_event(
            AuditAction.NOTHING_TO_DO, reason="nothing_to_do", detail=summary, trigger=trigger, user=user
        )
    return answers.answer(report, None, error)


def act_on(task_ids: Collection[str], *, mark_terminal: bool, trigger: Trigger, user: str) -> Answer:
    """Recover (or mark terminal) the chosen tasks now, refusing live ones; one result per task id.

    Every task refused, and a request refused whole, is audited under ``user``."""
    with _refusals_audited(trigger, user):
        _require_enabled()
        answer = _act_on(task_ids, mark_terminal, trigger, user)
    for result in answer.results:
        if result.refused:
            o = result.outcome
            audit.record_event(
                AuditAction.REFUSED,
                reason=result.status.value,
                detail=result.message,
                trigger=trigger,
                user=user,
                task_id=result.task_id,
                task_name=o.task_name if o else "",
                worker=o.worker if o else "",
            )
    return answer


def _act_on(task_ids: Collection[str], mark_terminal: bool, trigger: Trigger, user: str) -> Answer:
    wanted = Action.MARK_TERMINAL if mark_terminal else Action.RECOVER
    options = Options(
        trigger=trigger,
        user=user,
        grace_seconds=0,  # the operator has looked; the worker's answer still protects live tasks
        task_ids=frozenset(task_ids),
        acts=frozenset({wanted}),
        mark_terminal=mark_terminal,
    )
    report, error = _run(options)
    _forget_verdicts()
    answer = answers.answer(report, wanted, error)
    missing = sorted(set(task_ids) - {o.decision.task_id for o in report.outcomes})
    gone = "no running task has this id (it ended or never ran)"
    answer.results.extend(Result(t, Status.NOT_FOUND, f"{t}: {gone}.") for t in missing)
    return answer


def lift_caps(task_ids: Collection[str], *, trigger: Trigger, user: str) -> list[lift.Lifted]:
    """Lift the recovery cap of each chosen task marked terminal at it, so the next sweep recovers it once
    more; one ``Lifted`` per task id. Each lift, each task refused and a request refused whole is audited
    under ``user``."""
    with _refusals_audited(trigger, user):
        _require_enabled()
        with mapped():
            done = lift.lift(current_app, ledger_for(), task_ids, trigger=trigger, user=user)
    for result in done:
        if not result.lifted:
            audit.record_event(
                AuditAction.REFUSED,
                reason="not_capped",
                detail=result.message,
                trigger=trigger,
                user=user,
                task_id=result.task_id,
                task_name=result.task_name,
                worker=result.worker,
            )
    _forget_verdicts()
    return done


@contextlib.contextmanager
def _refusals_audited(trigger: Trigger, user: str, *, audited: bool = True) -> Iterator[None]:
    """Audit an operation refused whole (locked, switched off, a service out of reach), then let it go on."""
    try:
        yield
    except Refused as exc:
        if audited:
            audit.record_event(
                AuditAction.REFUSED, reason=exc.problem.value, detail=str(exc), trigger=trigger, user=user
            )
        raise


def _run(options: Options) -> tuple[Report, str | None]:
    """The sweep's report, and why it stopped part way (``None``: it did not)."""
    with mapped():
        try:
            return run(options), None
        except SweepFailed as exc:
            return exc.report, str(exc)


def in_flight(trigger: Trigger, *, page: int = 1, ask_workers: bool = False) -> inflight.Judged:
    """A page of the running tasks with their verdicts, from a dry run shared for a few seconds by every
    viewer (``inflight.py``); the workers are broadcast to only with ``ask_workers``."""

    def judge(ask: bool) -> list[Outcome]:
        return run(Options(trigger=trigger, dry_run=True, ask_workers=ask)).outcomes

    with mapped():
        return inflight.page_of(judge, _heartbeat_ages, page=page, ask_workers=ask_workers)


def status() -> dict[str, Any]:
    """What the last whole sweep recorded, the leases held now and the newest audit row (docs/api.md)."""
    with mapped():
        swept = last_sweep()
        lease_count = leases.count()
        last = (
            apps.get_model("celery_orphans", "OrphanEvent")
            .objects.values("created_at", "action", "task_id", "task_name", "trigger", "triggered_by")
            .order_by("-created_at", "-id")
            .first()
        )
    running, orphans = counted(swept.pop("decisions")) if swept else (None, None)
    return {
        "enabled": settings.ENABLED,
        "shadow_mode": settings.SHADOW_MODE,
        "last_sweep": swept,
        "in_flight": running,
        "orphans": orphans,
        "leases": lease_count,
        "last_action": last,
    }


def wait_for_rate(user: Any, trigger: Trigger, limit: ratelimit.Limit = RATE_LIMIT) -> int:
    """Count one costly request of ``user`` (an action, a sweep, a broadcast to the workers), through any
    door; the seconds to wait when over ``limit``, else 0. A refusal is audited once per window."""
    with mapped():
        wait = ratelimit.hit(f"user:{user.pk}", limit)
    name = user.get_username()
    if wait and not audit.refused_lately(name, RATE_LIMITED, limit.seconds):
        detail = f"more than {limit.hits} actions or worker queries in {limit.seconds} s"
        audit.record_event(
            AuditAction.REFUSED, reason=RATE_LIMITED, detail=detail, trigger=trigger, user=name
        )
    return wait


def _forget_verdicts() -> None:
    """The in-flight page judges again at its next load, so an operator sees what their action did."""
    with logs.redis_fault_let_go(logger, "could not drop the in-flight page's shared verdicts"):
        inflight.forget()


def _heartbeat_ages(outcomes: Iterable[Outcome]) -> dict[str, float]:
    """Seconds since each task's owner last renewed its lease: its boot, or the node's newest boot for a
    task without an entry."""
    owners: dict[str, list[tuple[str, str]]] = {}
    heartbeats: dict[tuple[str, str], float] = {}  # none on a fault: no age then
    with logs.redis_fault_let_go(logger, "could not read the workers' last heartbeats"):
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
        heartbeats = leases.last_heartbeats({pair for pairs in owners.values() for pair in pairs}, conn)
    now = time.time()
    return {
        task_id: now - max(heartbeats[p] for p in pairs if p in heartbeats)
        for task_id, pairs in owners.items()
        if any(p in heartbeats for p in pairs)
    }
