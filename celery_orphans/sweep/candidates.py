"""Gathering candidates: what the result rows and the ledger say is running, merged by task id."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from datetime import timezone as dt_timezone
from typing import Any

from celery import Celery

from celery_orphans import registry
from celery_orphans.entry import Entry, Unreadable
from celery_orphans.ledger import Fence, Ledger
from celery_orphans.reconcile import Candidate, WorkerView
from celery_orphans.sweep import audit
from celery_orphans.sweep.rows import Row, rows_by_id, started_rows
from celery_orphans.sweep.values import BootScope


def own_tasks(
    app: Celery, ledger: Ledger, scope: BootScope
) -> tuple[list[Candidate], dict[str, Entry], dict[str, WorkerView]]:
    """At boot: the tasks recorded under this node name before this boot began."""
    found, entries = gather(app, ledger, scope.booted_at)
    candidates = [c for c in found if c.worker == scope.node]
    view = WorkerView(replied=True, held=scope.held(), fresh_boots=frozenset({scope.boot}), at_boot=True)
    return candidates, entries, {scope.node: view}


@dataclass(frozen=True)
class Found:
    """What is running by the result rows and the ledger's index, before any entry is read."""

    rows: dict[str, Row]
    ledger_ids: list[str]


def find(ledger: Ledger, cutoff: datetime | None, only: frozenset[str] | None = None) -> Found:
    """STARTED rows and ledger ids older than ``cutoff`` (or all), of the ``only`` ids, in two reads."""
    rows = {row.task_id: row for row in started_rows(cutoff, only)}
    ledger_ids = ledger.older_than(float("inf") if cutoff is None else cutoff.timestamp())
    if only is not None:
        ledger_ids = [task_id for task_id in ledger_ids if task_id in only]
    return Found(rows, ledger_ids)


def merge(app: Celery, ledger: Ledger, found: Found) -> tuple[list[Candidate], dict[str, Entry]]:
    """Read the entries and fences of what ``find`` found, and merge them with the rows by id."""
    rows = dict(found.rows)
    rows.update(rows_by_id([task_id for task_id in found.ledger_ids if task_id not in rows]))
    ids = sorted(set(rows) | set(found.ledger_ids))
    loaded, fences = ledger.load_with_fences(ids)
    entries = {task_id: e for task_id, e in loaded.items() if isinstance(e, Entry)}
    sent = already_sent(entries, fences)
    tasks = app.tasks  # a property that takes a lock: read once, not once per candidate
    candidates = [
        candidate(
            tasks, task_id, rows.get(task_id), loaded.get(task_id), fences[task_id].attempts, task_id in sent
        )
        for task_id in ids
    ]
    return candidates, entries


def already_sent(entries: dict[str, Entry], fences: dict[str, Fence]) -> set[str]:
    """The entries whose delivery a recovery already sent again; only its bookkeeping may be missing.

    The fence says so once the message is out. Should Redis have failed right then, the recovery's
    audit row, committed with its other bookkeeping, says so instead.
    """
    sent = {task_id for task_id, e in entries.items() if fences[task_id].sent_again(e)}
    unsure = {
        task_id: (fences[task_id].attempts, e.recorded_at)
        for task_id, e in entries.items()
        if task_id not in sent and fences[task_id].claimed_by_latest(e)
    }
    return sent | audit.recorded_recoveries(unsure) if unsure else sent


def gather(
    app: Celery, ledger: Ledger, cutoff: datetime | None, only: frozenset[str] | None = None
) -> tuple[list[Candidate], dict[str, Entry]]:
    """Every STARTED row and ledger entry older than ``cutoff`` (or all), of the ``only`` ids, by task id."""
    return merge(app, ledger, find(ledger, cutoff, only))


def candidate(
    tasks: Mapping[str, Any],
    task_id: str,
    row: Row | None,
    entry: Entry | Unreadable | None,
    attempts: int,
    sent_again: bool = False,
) -> Candidate:
    """Merge what the row and the ledger entry say about one task."""
    problem = entry.reason if isinstance(entry, Unreadable) else None
    entry = entry if isinstance(entry, Entry) else None
    name = entry.task_name if entry else (row.task_name if row else None)
    if entry and row and row.task_name and row.task_name != entry.task_name:
        problem = f"the result row says {row.task_name!r} but the ledger entry says {entry.task_name!r}"
    if row and row.problem:
        problem = row.problem
    starts = [t for t in (row.started_at if row else None, _entry_start(entry)) if t is not None]
    policy = registry.policy_of(tasks.get(name)) if name else None
    return Candidate(
        task_id=task_id,
        task_name=name,
        worker=entry.node if entry else (row.worker if row else None),
        boot=entry.boot if entry else None,
        started_at=max(starts) if starts else None,
        row_status=row.status if row else None,
        has_entry=entry is not None,
        attempts=attempts,
        task_known=name is not None and name in tasks,
        recoverable=policy is not None,
        group=policy.group if policy else None,
        max_attempts=policy.max_attempts if policy else None,
        content_type=entry.delivery.content_type if entry else None,
        problem=problem,
        sent_again=sent_again and entry is not None,
        handed_back_at=_moment(entry.handed_back_at) if entry and entry.handed_back_at else None,
    )


def _entry_start(entry: Entry | None) -> datetime | None:
    return None if entry is None else _moment(entry.recorded_at)


def _moment(timestamp: float) -> datetime:
    return datetime.fromtimestamp(timestamp, tz=dt_timezone.utc)
