"""Gathering candidates: what the result rows and the ledger say is running, merged by task id."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from datetime import timezone as dt_timezone
from typing import Any

from celery import Celery, states

from celery_orphans import endings, leases, registry
from celery_orphans.entry import Entry, Unreadable
from celery_orphans.ledger import Fence, Ledger
from celery_orphans.observations import Candidate, WorkerView
from celery_orphans.recovery import audit
from celery_orphans.recovery.rows import Row, rows_by_id, started_rows
from celery_orphans.sweep.values import BootScope


def own_tasks(
    app: Celery, ledger: Ledger, scope: BootScope
) -> tuple[list[Candidate], dict[str, Entry], dict[str, WorkerView]]:
    """At boot: the tasks recorded under this node name before this boot began, and what this boot knows
    of them: what it holds, and which boots of its name are alive by their leases (this one among them)."""
    found, entries = gather(app, ledger, scope.booted_at)
    candidates = [c for c in found if c.worker == scope.node]
    alive = leases.fresh_boots([scope.node], ledger.client, prune=False).get(scope.node, frozenset())
    view = WorkerView(replied=True, held=scope.held(), fresh_boots=alive | {scope.boot}, at_boot=True)
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
    return Found(without_ended(ledger, rows, set(ledger_ids)), ledger_ids)


def without_ended(ledger: Ledger, rows: dict[str, Row], recorded: set[str]) -> dict[str, Row]:
    """``rows`` less those an execution left when it ended without a state (``endings.py``), unless a
    ledger entry records a later delivery of the task (then the entry is judged)."""
    unrecorded = [task_id for task_id in rows if task_id not in recorded]
    ended = endings.read(ledger.client, ledger.keys, unrecorded)
    if not ended:
        return rows
    return {
        task_id: row
        for task_id, row in rows.items()
        if task_id not in ended or not ended[task_id].covers(row.worker, row.started_at)
    }


def ended_since(ledger: Ledger, candidates: list[Candidate], asked: set[str]) -> list[Candidate]:
    """``candidates`` less the ``asked`` ones whose execution ended without a state since ``find`` read
    the endings: the node's answer no longer names such a task, and its ending says why."""
    ended = endings.read(ledger.client, ledger.keys, sorted(asked)) if asked else {}
    if not ended:
        return candidates
    return [
        c for c in candidates if c.task_id not in ended or not ended[c.task_id].covers(c.worker, c.started_at)
    ]


def merge(app: Celery, ledger: Ledger, found: Found) -> tuple[list[Candidate], dict[str, Entry]]:
    """Read the entries and fences of what ``find`` found, and merge them with the rows by id."""
    rows = dict(found.rows)
    rows.update(rows_by_id([task_id for task_id in found.ledger_ids if task_id not in rows]))
    ids = sorted(set(rows) | set(found.ledger_ids))
    loaded, fences = ledger.load_with_fences(ids)
    # An entry gone between the two reads was released: its task ended, and its row says so or there is
    # none. Nothing is left to judge (judged, it would be forgotten and audited for a healthy task).
    ids = [t for t in ids if loaded.get(t) is not None or _started(rows.get(t))]
    entries = {task_id: e for task_id, e in loaded.items() if isinstance(e, Entry)}
    sent = already_sent(entries, fences)
    tasks = app.tasks  # a property that takes a lock: read once, not once per candidate
    candidates = [
        candidate(
            tasks,
            task_id,
            rows.get(task_id),
            loaded.get(task_id),
            fences[task_id].attempts,
            task_id in sent,
            lifted=fences[task_id].lifted,
        )
        for task_id in ids
    ]
    return candidates, entries


def _started(row: Row | None) -> bool:
    return row is not None and row.status == states.STARTED


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
    *,
    lifted: int = 0,
) -> Candidate:
    """Merge what the row and the ledger entry say about one task."""
    problem = entry.reason if isinstance(entry, Unreadable) else None
    entry = entry if isinstance(entry, Entry) else None
    name = entry.task_name if entry else (row.task_name if row else None)
    recorded = _moment(entry.recorded_at) if entry else None
    # Task.replace() sends another task under the same id: a row written before its entry was is the
    # replaced execution's, not a disagreement.
    replaced = recorded and row and row.started_at and row.started_at < recorded
    if entry and row and row.task_name and row.task_name != entry.task_name and not replaced:
        problem = f"the result row says {row.task_name!r} but the ledger entry says {entry.task_name!r}"
    if row and row.problem:
        problem = row.problem
    starts = [t for t in (row.started_at if row else None, recorded) if t is not None]
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
        lifted=lifted,
        content_type=entry.delivery.content_type if entry else None,
        problem=problem,
        sent_again=sent_again and entry is not None,
        handed_back_at=_moment(entry.handed_back_at) if entry and entry.handed_back_at else None,
    )


def _moment(timestamp: float) -> datetime:
    return datetime.fromtimestamp(timestamp, tz=dt_timezone.utc)
