"""The operators' JSON endpoints, mounted with ``path("orphans/", include("celery_orphans.urls"))``.

They serve the operators' service (``operations.py``) over HTTP; docs/api.md describes them.

``GET status/``
    For health checks and dashboards, cheap to poll: what the last whole sweep recorded (``last_sweep``:
    ``at``, ``age_seconds``, ``trigger``, ``ok``, ``summary``, ``error``; ``null`` before the first), the
    tasks it saw running counted by verdict (``in_flight``) and the orphans among them (``orphans``), how
    many worker boots hold a lease now, and the latest audit-log entry as ``last_action``. It runs no
    sweep and asks no worker. 503 when Redis or the database cannot be reached.
``POST sweep/``
    An empty body or ``{}`` runs one sweep now; ``{"task_ids": ["...", ...]}`` recovers only those tasks,
    at once (no grace), refusing live ones and never marking any terminal. Either way the answer is
    ``answers.Answer``'s JSON: a summary and one result per task. 400 for a body that is not that;
    409 while another sweep runs or with ``CELERY_ORPHANS_ENABLED`` off; 503 without Redis, the database
    or the broker, or when carrying out an action failed (the body says which).

Both read ``request.user``, so whatever authentication the project runs (sessions, or a middleware that
sets the user from a token) applies: 401 without a user, 403 without the permission
``celery_orphans.recover_orphans``. ``status/`` needs only ``celery_orphans.view_status`` (or
``recover_orphans``), or no user at all with ``Authorization: Bearer <CELERY_ORPHANS_STATUS_TOKEN>``.
The POST is CSRF-protected and limited per user to ``RATE_LIMIT`` (5 requests in any 60 seconds, a
sliding window counted in Redis before the body is read, together with the same user's admin actions):
429 with ``Retry-After`` beyond it.
Every action is written to the audit log with the trigger ``api`` and the user's name.
"""

from __future__ import annotations

import functools
import hmac
import json
from collections.abc import Callable
from typing import Any

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.csrf import csrf_protect

from celery_orphans import operations
from celery_orphans.conf import settings
from celery_orphans.models import Trigger
from celery_orphans.operations import PERMISSION, STATUS_PERMISSION, Problem, Refused

RATE_LIMIT = operations.RATE_LIMIT
# The one HTTP status of each reason an operation did nothing.
STATUS_OF = {
    Problem.LOCKED: 409,
    Problem.SWITCHED_OFF: 409,
    Problem.UNAVAILABLE: 503,
    Problem.MISCONFIGURED: 503,
}

View = Callable[[HttpRequest], HttpResponse]


def _error(status: int, message: str, **extra: Any) -> JsonResponse:
    return JsonResponse({"error": message, **extra}, status=status)


def _refused(exc: Refused) -> JsonResponse:
    return _error(STATUS_OF[exc.problem], str(exc), problem=exc.problem.value)


def _token_given(request: HttpRequest) -> bool:
    """Whether the request carries ``Authorization: Bearer`` with the status token, when one is set."""
    token = settings.STATUS_TOKEN
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    return (
        token is not None
        and scheme.lower() == "bearer"
        and hmac.compare_digest(given.strip().encode(), token.encode())
    )


def _refusal(request: HttpRequest, permissions: tuple[str, ...]) -> JsonResponse | None:
    if not request.user.is_authenticated:
        return _error(401, "authentication required")
    if not any(request.user.has_perm(p) for p in permissions):
        return _error(403, f"the permission {' or '.join(permissions)} is required")
    return None


def _endpoint(method: str, *permissions: str, token: bool = False) -> Callable[[View], View]:
    """Allow one method, to a user with one of the permissions (or the status token, where ``token``);
    answer JSON for every refusal."""

    def decorate(view: View) -> View:
        @functools.wraps(view)
        def wrapper(request: HttpRequest) -> HttpResponse:
            refused = None if token and _token_given(request) else _refusal(request, permissions)
            if refused is not None:
                return refused
            if request.method != method:
                response = _error(405, f"use {method}")
                response["Allow"] = method
                return response
            try:
                return view(request)
            except Refused as exc:
                return _refused(exc)

        return never_cache(wrapper)

    return decorate


@_endpoint("GET", STATUS_PERMISSION, PERMISSION, token=True)
def status(request: HttpRequest) -> HttpResponse:
    """What the last sweep found, and the leases now; see the module docstring."""
    return JsonResponse(operations.status())


@_endpoint("POST", PERMISSION)
@csrf_protect
def sweep_now(request: HttpRequest) -> HttpResponse:
    """Run a sweep, or recover the given task ids; see the module docstring."""
    wait = operations.wait_for_rate(request.user, Trigger.API)
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
    if task_ids is None:
        answer = operations.sweep(Trigger.API, user)
    else:
        answer = operations.act_on(task_ids, mark_terminal=False, trigger=Trigger.API, user=user)
    failed = answer.error is not None or any(r.failed for r in answer.results)
    return JsonResponse(answer.as_json(), status=503 if failed else 200)


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
    return operations.clean_task_ids(data["task_ids"]) if "task_ids" in data else None
