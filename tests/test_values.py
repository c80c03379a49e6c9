"""The sweep's values: a report's summary line, and the one JSON shape of an outcome."""

from __future__ import annotations

from celery_orphans.decision import Action, Decision, Evidence, Reason
from celery_orphans.recovery.outcome import Outcome
from celery_orphans.sweep.values import Report


def outcome(action: Action, reason: Reason, *, done: bool = True, attempt: int | None = None) -> Outcome:
    decision = Decision(f"id-{action.value}-{reason.value}", action, reason, Evidence.NONE, "", attempt)
    return Outcome(decision, "demoapp.summarize", "w1@test", done=done)


def test_a_summary_counts_what_was_done_and_what_was_left() -> None:
    report = Report(
        [
            outcome(Action.RECOVER, Reason.RECOVERABLE, attempt=1),
            outcome(Action.RECOVER, Reason.ALREADY_SENT, attempt=1),
            outcome(Action.MARK_TERMINAL, Reason.NOT_RECOVERABLE),
            outcome(Action.MARK_TERMINAL, Reason.LIMIT_REACHED, done=False),  # failed: not counted
            outcome(Action.LEAVE, Reason.ALIVE, done=False),
            outcome(Action.REPORT, Reason.UNREADABLE, done=False),
        ],
        duration=1.234,
    )

    assert report.summary() == (
        "recovered 1 orphaned tasks, marked 1 terminal, forgotten 0 finished, 1 alive or in grace, "
        "1 unreadable, finished recording 1 sent earlier (1.23s)"
    )
    assert report.count(Action.MARK_TERMINAL) == 2
    assert report.count(Action.MARK_TERMINAL, done_only=True) == 1


def test_a_summary_names_apart_each_kind_of_task_it_could_only_report() -> None:
    report = Report(
        [
            outcome(Action.REPORT, Reason.UNREADABLE, done=False),
            outcome(Action.REPORT, Reason.UNKNOWN_TASK, done=False),
            outcome(Action.REPORT, Reason.UNKNOWN_TASK, done=False),
            outcome(Action.REPORT, Reason.NO_WORKER, done=False),
        ]
    )

    assert report.summary() == (
        "recovered 0 orphaned tasks, marked 0 terminal, forgotten 0 finished, 0 alive or in grace, "
        "1 unreadable, 2 of a task not registered here, 1 without a worker (0.00s)"
    )
    assert report.reported() == {Reason.UNREADABLE: 1, Reason.UNKNOWN_TASK: 2, Reason.NO_WORKER: 1}


def test_a_dry_run_summary_says_what_would_have_been_done() -> None:
    report = Report([outcome(Action.RECOVER, Reason.RECOVERABLE, done=False)], dry_run=True)

    assert report.summary().startswith("would have recovered 1 orphaned tasks, would have marked 0 terminal")


def test_an_outcome_has_one_json_shape() -> None:
    o = Outcome(
        Decision("t1", Action.RECOVER, Reason.RECOVERABLE, Evidence.LEASE_LAPSED, "recovery 1 of 3", 1),
        "demoapp.summarize",
        "w1@test",
        done=True,
    )

    assert o.as_json() == {
        "task_id": "t1",
        "task_name": "demoapp.summarize",
        "worker": "w1@test",
        "action": "recover",
        "reason": "recoverable",
        "evidence": "lease_lapsed",
        "detail": "recovery 1 of 3",
        "attempt": 1,
        "done": True,
        "error": None,
    }
