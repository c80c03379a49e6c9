"""The operators' JSON endpoints, mounted with ``path("orphans/", include("celery_orphans.urls"))``.

They serve the operators' service (``operations.py``) over HTTP; docs/api.md describes them.

``GET status/``
    For health checks and dashboards, cheap to poll: what the last whole sweep recorded (``last_sweep``:
    ``at``, ``age_seconds``, ``trigger``, ``ok``, ``summary``, ``error``; ``null`` before the first), the
    tasks it saw running counted by verdict (``in_flight``) and the orphans among them (``orphans``), how
    many worker boots hold a lease now, and the latest audit-log entry as ``last_action``. It runs no
    sweep and asks no worker. 503 when Redis cannot be reached.
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
import functools
import json
from collections.abc import Callable
from typing import Any

import redis
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.csrf import csrf_protect

from celery_orphans import leases, ratelimit
from celery_orphans.conf import settings
from celery_orphans.exceptions import SweepLocked
from celery_orphans.models import OrphanEvent, Trigger
from celery_orphans.operations import (
    PERMISSION,
    SWEEP_ERRORS,
    SwitchedOff,
    act_on,
    clean_task_ids,
    counted,
    sweep_all,
)
from celery_orphans.reconcile import Action
from celery_orphans.sweep.runner import last_sweep
from celery_orphans.sweep.values import Report, SweepFailed

RATE_LIMIT = ratelimit.Limit(hits=5, seconds=60)

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
    """What the last sweep found, and the leases now; see the module docstring."""
    try:
        swept = last_sweep()
        lease_count = leases.count()
    except redis.RedisError as exc:
        return _error(503, f"cannot reach Redis: {exc}")
    running, orphans = counted(swept.pop("decisions")) if swept else (None, None)
    last = (
        OrphanEvent.objects.values("created_at", "action", "task_id", "task_name", "trigger", "triggered_by")
        .order_by("-created_at", "-id")
        .first()
    )
    return JsonResponse(
        {
            "enabled": settings.ENABLED,
            "shadow_mode": settings.SHADOW_MODE,
            "last_sweep": swept,
            "in_flight": running,
            "orphans": orphans,
            "leases": lease_count,
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
        results = act_on(task_ids, mark_terminal=False, trigger=Trigger.API, user=user)
    except SweepFailed as exc:
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


def _swept(report: Report, error: str | None = None) -> JsonResponse:
    outcomes = [o.as_json() for o in report.outcomes if o.decision.action is not Action.LEAVE]
    body = {"summary": report.summary(), "shadow": report.shadow, "outcomes": outcomes}
    return JsonResponse({**body, "error": error}, status=503) if error else JsonResponse(body)
