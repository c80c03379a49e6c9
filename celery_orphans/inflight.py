"""The running tasks' verdicts for the in-flight page: one dry run, shared by every viewer for a few seconds.

A dry run over every ``STARTED`` row and ledger entry costs seconds at a hundred thousand rows, so its
outcome is kept in Redis for ``CELERY_ORPHANS_IN_FLIGHT_CACHE_SECONDS``, one page of ``PAGE_SIZE``
tasks per key beside the counts, and every process serving the page reads it there. While none is
fresh, one load runs the dry run (it holds a lock) and the others wait for its result instead of
running their own. The workers are asked about the tasks only their result rows know of only when a
viewer asks; a load that does not ask judges them by their leases alone.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from celery_orphans.conf import settings
from celery_orphans.decision import Action, Decision, Evidence, Reason
from celery_orphans.recovery.outcome import Outcome
from celery_orphans.store import Keys, client
from celery_orphans.verdicts import InFlight, verdict

PAGE_SIZE = 500
# How long a load waits for another's dry run before running its own; longer than a dry run takes.
WAIT_SECONDS = 60.0
_POLL_SECONDS = 0.05


@dataclass(frozen=True)
class Judged:
    """One page of the running tasks, oldest first, and what the whole dry run counted."""

    rows: list[InFlight]
    counts: list[tuple[str, int]]  # by verdict, most first
    total: int
    page: int
    pages: int
    asked: bool  # the workers were asked
    judged_at: float  # Unix time of the dry run


def page_of(
    judge: Callable[[bool], list[Outcome]],
    heartbeat_ages: Callable[[list[Outcome]], dict[str, float]],
    *,
    page: int = 1,
    ask_workers: bool = False,
) -> Judged:
    """Page ``page`` (from 1) of the verdicts, from a fresh shared dry run, or from ``judge(ask_workers)``.

    ``heartbeat_ages`` gives the seconds since each shown task's worker last renewed its lease, read at
    every load.
    """
    fresh = settings.IN_FLIGHT_CACHE_SECONDS
    if fresh:
        conn, base = client(), f"{Keys.current().prefix}:inflight-page:{'asked' if ask_workers else 'leases'}"
        meta = _cached_meta(conn, base) or _fill(conn, base, lambda: judge(ask_workers), fresh)
        pages = _pages(meta["total"])
        page = min(max(1, page), pages)
        raw = conn.get(f"{base}:{meta['run']}:{page}")
        outcomes = [_outcome(row) for row in json.loads(raw)] if raw else []
    else:
        ordered = sorted(judge(ask_workers), key=_age_order)
        meta = {"at": time.time(), "total": len(ordered), "counts": _counts(ordered)}
        pages = _pages(len(ordered))
        page = min(max(1, page), pages)
        outcomes = ordered[(page - 1) * PAGE_SIZE : page * PAGE_SIZE]
    ages = heartbeat_ages(outcomes)
    rows = [InFlight(o, *verdict(o.decision), heartbeat_age=ages.get(o.decision.task_id)) for o in outcomes]
    counts = [(name, count) for name, count in meta["counts"]]
    return Judged(rows, counts, meta["total"], page, pages, ask_workers, meta["at"])


def forget() -> None:
    """Drop the shared verdicts: the next load judges again (after an operator acted on some)."""
    conn, prefix = client(), f"{Keys.current().prefix}:inflight-page"
    conn.delete(f"{prefix}:asked:meta", f"{prefix}:leases:meta")


def _cached_meta(conn: Any, base: str) -> dict[str, Any] | None:
    raw = conn.get(f"{base}:meta")
    return None if raw is None else dict(json.loads(raw))


def _pages(total: int) -> int:
    return max(1, -(-total // PAGE_SIZE))


def _counts(outcomes: list[Outcome]) -> list[tuple[str, int]]:
    return Counter(verdict(o.decision)[0].value.replace("_", " ") for o in outcomes).most_common()


def _fill(conn: Any, base: str, judge: Callable[[], list[Outcome]], fresh: float) -> dict[str, Any]:
    """Run the dry run unless another load is running it, then wait for that one's result."""
    deadline = time.monotonic() + WAIT_SECONDS
    while not conn.set(f"{base}:lock", "1", nx=True, px=int(WAIT_SECONDS * 1000)):
        if time.monotonic() > deadline:
            break  # its runner died or is stuck: judge without it
        time.sleep(_POLL_SECONDS)
        meta = _cached_meta(conn, base)
        if meta is not None:
            return meta
    try:
        return _store(conn, base, judge(), fresh)
    finally:
        conn.delete(f"{base}:lock")


def _store(conn: Any, base: str, outcomes: list[Outcome], fresh: float) -> dict[str, Any]:
    outcomes = sorted(outcomes, key=_age_order)
    run = f"{time.time():.6f}"
    meta = {"run": run, "at": time.time(), "total": len(outcomes), "counts": _counts(outcomes)}
    # The pages outlive the counts that name them, so a load that read the counts finds its page.
    keep_ms = max(1, int(fresh * 1000))
    pipe = conn.pipeline(transaction=False)
    for start in range(0, len(outcomes), PAGE_SIZE):
        page = [_row(o) for o in outcomes[start : start + PAGE_SIZE]]
        pipe.set(f"{base}:{run}:{start // PAGE_SIZE + 1}", json.dumps(page), px=keep_ms + 30_000)
    pipe.set(f"{base}:meta", json.dumps(meta), px=keep_ms)
    pipe.execute()
    return meta


def _age_order(o: Outcome) -> tuple[bool, float]:
    return (o.started_at is None, o.started_at.timestamp() if o.started_at else 0.0)


def _row(o: Outcome) -> list[Any]:
    d = o.decision
    started = o.started_at.timestamp() if o.started_at else None
    return [d.task_id, o.task_name, o.worker, d.action.value, d.reason.value, d.evidence.value, d.detail,
            d.attempt, started, o.boot]  # fmt: skip


def _outcome(row: list[Any]) -> Outcome:
    task_id, name, worker, action, reason, evidence, detail, attempt, started, boot = row
    d = Decision(task_id, Action(action), Reason(reason), Evidence(evidence), detail, attempt)
    at = None if started is None else datetime.fromtimestamp(started, tz=timezone.utc)
    return Outcome(d, name, worker, started_at=at, boot=boot)
