"""The pure decision core: every branch of ``decide`` and ``judge``, with no database and no Redis."""

from __future__ import annotations

import dataclasses
import itertools
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from celery_orphans.decision import ORPHAN_EVIDENCE, Action, Decision, Evidence, Reason
from celery_orphans.observations import Candidate, WorkerView
from celery_orphans.rules import (
    CLOCK_TOLERANCE,
    HAND_BACK_GRACE,
    READY_STATES,
    SAFE_CONTENT_TYPES,
    Limits,
    after_pool_loss,
    after_redelivery,
    asks_about,
    decide,
    defer_excess,
    judge,
    worth_asking,
)

NOW = datetime(2025, 1, 1, 12, 0, tzinfo=timezone.utc)
GRACE = timedelta(seconds=10)
OLD = NOW - timedelta(minutes=5)  # well outside the grace period
TASK = "t-1"
NODE = "celery@host"
BOOT = "boot-a"

SILENT = WorkerView(replied=False)
ANSWERED_EMPTY = WorkerView(replied=True)
HOLDS = WorkerView(replied=True, held=frozenset({TASK}))
AT_BOOT_EMPTY = WorkerView(replied=True, at_boot=True, fresh_boots=frozenset({"boot-b"}))  # the booting one
AT_BOOT_HOLDS = WorkerView(replied=True, held=frozenset({TASK}), at_boot=True)
AT_BOOT_TWIN = WorkerView(replied=True, at_boot=True, fresh_boots=frozenset({BOOT, "boot-b"}))


def candidate(**overrides: Any) -> Candidate:
    """A recoverable JSON task with a ledger entry, started long ago, never recovered: recover if orphaned."""
    fields: dict[str, Any] = {
        "content_type": "application/json",
        "task_id": TASK,
        "task_name": "demoapp.work",
        "worker": NODE,
        "boot": BOOT,
        "started_at": OLD,
        "row_status": "STARTED",
        "has_entry": True,
        "recoverable": True,
    }
    return Candidate(**{**fields, **overrides})


def limits(**overrides: Any) -> Limits:
    fields: dict[str, Any] = {"now": NOW, "grace": GRACE, "max_attempts": 3, "groups": {}}
    return Limits(**{**fields, **overrides})


# --- judge: alive or gone -------------------------------------------------------------------------


FRESH = frozenset({BOOT})
GONE = WorkerView(replied=False, gone_boots=frozenset({BOOT}))
EXITED = WorkerView(replied=False, gone_boots=frozenset({BOOT}), exited_boots=frozenset({BOOT}))


@pytest.mark.parametrize(
    ("boot", "view", "expected"),
    [
        # A ledger entry names the boot: its lease decides, a reply only says what it holds.
        pytest.param(
            BOOT, WorkerView(replied=False, fresh_boots=FRESH), Evidence.BOOT_ALIVE, id="boot-alive"
        ),
        pytest.param(
            BOOT,
            WorkerView(replied=True, held=frozenset({TASK}), fresh_boots=FRESH),
            Evidence.WORKER_HOLDS_TASK,
            id="boot-alive-and-holds-it",
        ),
        pytest.param(
            BOOT,
            WorkerView(replied=True, held=frozenset({"other"}), fresh_boots=FRESH),
            Evidence.BOOT_ALIVE,
            id="boot-alive-answered-without-it-so-it-ends-there",
        ),
        pytest.param(BOOT, SILENT, Evidence.LEASE_LAPSED, id="boot-lapsed-no-leases"),
        pytest.param(BOOT, GONE, Evidence.LEASE_LAPSED, id="boot-lapsed-by-its-record"),
        pytest.param(BOOT, EXITED, Evidence.PROCESS_EXITED, id="boot-process-seen-to-exit"),
        pytest.param(BOOT, HOLDS, Evidence.LEASE_LAPSED, id="boot-lapsed-its-stale-run-is-forfeit"),
        pytest.param(
            BOOT,
            WorkerView(replied=True, fresh_boots=frozenset({"boot-b"})),
            Evidence.LEASE_LAPSED,
            id="boot-lapsed-restarted-under-the-same-name",
        ),
        # A booting worker's own view of its name's earlier boots.
        pytest.param(BOOT, AT_BOOT_EMPTY, Evidence.FOUND_AT_BOOT, id="own-next-boot-lacks-it"),
        pytest.param(None, AT_BOOT_EMPTY, Evidence.FOUND_AT_BOOT, id="own-next-boot-lacks-it-no-boot"),
        pytest.param(BOOT, AT_BOOT_HOLDS, Evidence.WORKER_HOLDS_TASK, id="own-next-boot-holds-it"),
        pytest.param(
            BOOT, AT_BOOT_TWIN, Evidence.BOOT_ALIVE, id="own-next-boot-lacks-it-a-live-twin-runs-it"
        ),
        pytest.param(
            None, AT_BOOT_TWIN, Evidence.FOUND_AT_BOOT, id="own-next-boot-lacks-it-no-boot-a-twin-up"
        ),
        # A result row alone: the node's answer, and its leases when it is silent.
        pytest.param(None, HOLDS, Evidence.WORKER_HOLDS_TASK, id="row-only-replied-and-holds-it"),
        pytest.param(
            None, ANSWERED_EMPTY, Evidence.WORKER_ANSWERED_WITHOUT_TASK, id="row-only-replied-without-it"
        ),
        pytest.param(
            None,
            WorkerView(replied=False, fresh_boots=frozenset({"boot-b"})),
            Evidence.NO_REPLY_LEASE_FRESH,
            id="row-only-silent-any-fresh-lease-under-the-node",
        ),
        pytest.param(None, SILENT, Evidence.NO_REPLY_NO_LEASE, id="row-only-silent-no-lease"),
    ],
)
def test_judge_reads_the_entrys_boot_lease_and_for_a_row_alone_the_nodes_answer(
    boot: str | None, view: WorkerView, expected: Evidence
) -> None:
    assert judge(candidate(boot=boot), view) is expected


def test_a_held_id_of_another_task_is_not_this_task_held() -> None:
    view = WorkerView(replied=True, held=frozenset({TASK}))
    assert judge(candidate(task_id="t-2", boot=None), view) is Evidence.WORKER_ANSWERED_WITHOUT_TASK


def test_a_reply_speaks_only_for_the_ids_the_worker_was_asked_about() -> None:
    view = WorkerView(replied=True, asked=frozenset({"t-2"}), fresh_boots=frozenset({"boot-b"}))

    assert judge(candidate(boot=None), view) is Evidence.NO_REPLY_LEASE_FRESH
    assert judge(candidate(task_id="t-2", boot=None), view) is Evidence.WORKER_ANSWERED_WITHOUT_TASK


def test_a_task_its_worker_handed_back_to_the_broker_is_left_to_the_broker_for_a_while() -> None:
    back = candidate(handed_back_at=NOW - timedelta(minutes=1))
    long_ago = candidate(handed_back_at=NOW - HAND_BACK_GRACE - timedelta(seconds=1))

    assert (decide(back, SILENT, limits()).action, decide(back, SILENT, limits()).reason) == (
        Action.LEAVE,
        Reason.HANDED_BACK,
    )
    assert decide(long_ago, SILENT, limits()).action is Action.RECOVER


# --- decide: cases that cannot be judged ----------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "reason", "detail_part"),
    [
        pytest.param({"problem": "unreadable ledger entry: boom"}, Reason.UNREADABLE, "boom", id="problem"),
        pytest.param(
            # the problem outranks every other gap in the record
            {"problem": "bad row", "worker": None, "task_name": None, "started_at": None},
            Reason.UNREADABLE,
            "bad row",
            id="problem-before-anything-else",
        ),
        pytest.param({"worker": None}, Reason.NO_WORKER, "no worker", id="no-worker"),
        pytest.param({"worker": ""}, Reason.NO_WORKER, "no worker", id="blank-worker"),
        pytest.param({"task_name": None}, Reason.UNKNOWN_TASK, "(no name)", id="no-task-name"),
        pytest.param({"task_name": ""}, Reason.UNKNOWN_TASK, "(no name)", id="blank-task-name"),
        pytest.param({"task_known": False}, Reason.UNKNOWN_TASK, "'demoapp.work'", id="unregistered-task"),
        pytest.param({"started_at": None}, Reason.UNREADABLE, "no start time", id="no-start-time"),
    ],
)
def test_records_that_cannot_be_judged_are_reported_and_left_untouched(
    overrides: dict[str, Any], reason: Reason, detail_part: str
) -> None:
    # A silent worker with no lease would make the task an orphan, were it judged at all.
    decision = decide(candidate(**overrides), SILENT, limits())

    assert decision.action is Action.REPORT
    assert decision.reason is reason
    assert detail_part in decision.detail
    assert decision.evidence is Evidence.NONE
    assert not decision.orphaned


# --- decide: grace --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "started_at",
    [
        pytest.param(NOW - GRACE + timedelta(microseconds=1), id="one-microsecond-inside"),
        pytest.param(NOW, id="just-now"),
        pytest.param(NOW + CLOCK_TOLERANCE, id="ahead-by-no-more-than-clocks-differ"),
    ],
)
def test_a_task_started_within_the_grace_period_is_left_alone(started_at: datetime) -> None:
    decision = decide(candidate(started_at=started_at), SILENT, limits())

    assert decision == Decision(TASK, Action.LEAVE, Reason.IN_GRACE)


@pytest.mark.parametrize(
    "started_at",
    [
        pytest.param(NOW + CLOCK_TOLERANCE + timedelta(microseconds=1), id="just-beyond-the-tolerance"),
        pytest.param(NOW + timedelta(days=400), id="a-year-ahead"),
    ],
)
@pytest.mark.parametrize("view", [SILENT, ANSWERED_EMPTY, HOLDS])
def test_a_start_in_the_future_is_reported_and_never_acted_on(started_at: datetime, view: WorkerView) -> None:
    decision = decide(candidate(started_at=started_at, sent_again=True), view, limits(grace=timedelta(0)))

    assert (decision.action, decision.reason) == (Action.REPORT, Reason.UNREADABLE)
    assert started_at.isoformat() in decision.detail
    assert "in the future" in decision.detail


@pytest.mark.parametrize(
    ("view", "evidence"),
    [
        pytest.param(EXITED, Evidence.PROCESS_EXITED, id="exited"),
        pytest.param(GONE, Evidence.LEASE_LAPSED, id="lapsed"),
    ],
)
@pytest.mark.parametrize(
    "started_at",
    [
        pytest.param(NOW, id="in-grace"),
        pytest.param(NOW + timedelta(seconds=30), id="its-worker-clock-ahead"),
    ],
)
def test_a_task_on_a_boot_known_gone_is_judged_at_once_whatever_its_start_time(
    view: WorkerView, evidence: Evidence, started_at: datetime
) -> None:
    decision = decide(candidate(started_at=started_at), view, limits())

    assert (decision.action, decision.evidence) == (Action.RECOVER, evidence)


@pytest.mark.parametrize(
    ("overrides", "view"),
    [
        pytest.param({}, SILENT, id="a-boot-without-a-record-may-be-taking-its-first-lease"),
        pytest.param({"boot": None, "has_entry": False}, EXITED, id="a-result-row-alone-names-no-boot"),
        pytest.param({"boot": "boot-b"}, EXITED, id="another-boot-of-the-node-is-gone"),
    ],
)
def test_a_task_in_its_grace_period_is_left_unless_its_own_boot_is_known_gone(
    overrides: dict[str, Any], view: WorkerView
) -> None:
    decision = decide(candidate(started_at=NOW, **overrides), view, limits())

    assert decision == Decision(TASK, Action.LEAVE, Reason.IN_GRACE)


@pytest.mark.parametrize("view", [EXITED, GONE, SILENT])
def test_a_minimum_age_asked_for_spares_a_younger_task_even_on_a_boot_known_gone(view: WorkerView) -> None:
    asked = limits(min_age=timedelta(minutes=5))
    young = decide(candidate(started_at=NOW - timedelta(seconds=15)), view, asked)
    old = decide(candidate(started_at=NOW - timedelta(minutes=5)), view, asked)

    assert young == Decision(TASK, Action.LEAVE, Reason.IN_GRACE)
    assert old.action is Action.RECOVER


@pytest.mark.parametrize(
    ("started_at", "grace"),
    [
        pytest.param(NOW - GRACE, GRACE, id="exactly-as-old-as-the-grace-period"),
        pytest.param(NOW, timedelta(0), id="zero-grace-started-this-instant"),
    ],
)
def test_a_task_whose_grace_period_has_ended_is_judged(started_at: datetime, grace: timedelta) -> None:
    decision = decide(candidate(started_at=started_at), SILENT, limits(grace=grace))

    assert decision.action is Action.RECOVER
    assert decision.evidence is Evidence.LEASE_LAPSED


# --- decide: alive --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("boot", "view", "evidence"),
    [
        pytest.param(
            BOOT,
            WorkerView(replied=True, held=frozenset({TASK}), fresh_boots=FRESH),
            Evidence.WORKER_HOLDS_TASK,
            id="worker-holds-task",
        ),
        pytest.param(
            BOOT, WorkerView(replied=False, fresh_boots=FRESH), Evidence.BOOT_ALIVE, id="boot-alive"
        ),
        pytest.param(None, HOLDS, Evidence.WORKER_HOLDS_TASK, id="row-only-worker-holds-task"),
        pytest.param(
            None,
            WorkerView(replied=False, fresh_boots=frozenset({"boot-b"})),
            Evidence.NO_REPLY_LEASE_FRESH,
            id="silent-no-boot-but-a-lease-under-the-node",
        ),
    ],
)
def test_a_task_whose_owner_may_be_alive_is_left_alone(
    boot: str | None, view: WorkerView, evidence: Evidence
) -> None:
    decision = decide(candidate(boot=boot), view, limits())

    assert decision == Decision(TASK, Action.LEAVE, Reason.ALIVE, evidence)
    assert not decision.orphaned


def test_a_missing_worker_view_counts_as_no_reply() -> None:
    with_entry = decide(candidate(), None, limits())
    without_entry = decide(candidate(boot=None, has_entry=False), None, limits())

    assert with_entry.evidence is Evidence.LEASE_LAPSED
    assert with_entry.action is Action.RECOVER
    assert without_entry.evidence is Evidence.NO_REPLY_NO_LEASE
    assert without_entry.action is Action.MARK_TERMINAL


# --- decide: orphans ------------------------------------------------------------------------------


@pytest.mark.parametrize("status", sorted(READY_STATES))
def test_an_orphan_whose_row_already_finished_is_forgotten(status: str) -> None:
    decision = decide(candidate(row_status=status, attempts=1), SILENT, limits())

    assert decision.action is Action.FORGET
    assert decision.reason is Reason.ALREADY_FINISHED
    assert decision.evidence is Evidence.LEASE_LAPSED
    assert status in decision.detail
    assert decision.attempt == 1


def test_a_finished_task_whose_boot_is_alive_is_left_for_its_worker_to_clean_up() -> None:
    # Between an acknowledgement and the entry's removal, which the worker sends a moment later.
    decision = decide(candidate(row_status="SUCCESS"), WorkerView(replied=False, fresh_boots=FRESH), limits())

    assert (decision.action, decision.evidence) == (Action.LEAVE, Evidence.BOOT_ALIVE)


def test_a_finished_row_is_forgotten_even_when_it_could_not_be_recovered() -> None:
    decision = decide(
        candidate(row_status="SUCCESS", recoverable=False, has_entry=False, attempts=99), SILENT, limits()
    )

    assert decision.action is Action.FORGET


@pytest.mark.parametrize(
    ("overrides", "policy_overrides", "reason", "detail_part"),
    [
        pytest.param(
            {"recoverable": False},
            {},
            Reason.NOT_RECOVERABLE,
            "not marked @recoverable",
            id="not-recoverable",
        ),
        pytest.param(
            {"group": "reports"},
            {"groups": {"reports": False}},
            Reason.GROUP_DISABLED,
            "'reports'",
            id="group-switched-off",
        ),
        pytest.param(
            {"has_entry": False, "boot": None}, {}, Reason.NO_LEDGER_ENTRY, "no ledger entry", id="no-entry"
        ),
        pytest.param({"attempts": 3}, {}, Reason.LIMIT_REACHED, "3 of 3", id="policy-cap-reached"),
        pytest.param({"attempts": 7}, {}, Reason.LIMIT_REACHED, "7 of 3", id="policy-cap-exceeded"),
        pytest.param(
            {"attempts": 1, "max_attempts": 1}, {}, Reason.LIMIT_REACHED, "1 of 1", id="own-lower-cap-wins"
        ),
        pytest.param(
            {"attempts": 5, "max_attempts": 5},
            {"max_attempts": 10},
            Reason.LIMIT_REACHED,
            "5 of 5",
            id="own-lower-cap-wins-over-higher-policy",
        ),
        pytest.param(
            {"started_at": OLD},
            {"max_age": timedelta(minutes=4)},
            Reason.TOO_OLD,
            "0:04:00",
            id="older-than-the-age-limit",
        ),
    ],
)
def test_an_orphan_that_cannot_be_recovered_is_marked_terminal(
    overrides: dict[str, Any], policy_overrides: dict[str, Any], reason: Reason, detail_part: str
) -> None:
    c = candidate(**overrides)
    decision = decide(c, SILENT, limits(**policy_overrides))

    assert decision.action is Action.MARK_TERMINAL
    assert decision.reason is reason
    assert detail_part in decision.detail
    assert decision.evidence in ORPHAN_EVIDENCE
    assert decision.attempt == c.attempts


def test_the_first_failed_condition_names_the_reason() -> None:
    # Fix the failures one by one, in the order they are checked: each fix reveals the next reason.
    fixes: list[tuple[dict[str, Any], Reason]] = [
        ({"row_status": "STARTED"}, Reason.ALREADY_FINISHED),
        ({"recoverable": True}, Reason.NOT_RECOVERABLE),
        ({"group": "reports"}, Reason.GROUP_DISABLED),
        ({"has_entry": True}, Reason.NO_LEDGER_ENTRY),
        ({"content_type": "application/json"}, Reason.UNSAFE_MESSAGE),
        ({"started_at": NOW - timedelta(minutes=1)}, Reason.TOO_OLD),
        ({"attempts": 0}, Reason.LIMIT_REACHED),
    ]
    broken: dict[str, Any] = {
        "row_status": "FAILURE",
        "recoverable": False,
        "group": "off",
        "has_entry": False,
        "content_type": None,
        "started_at": OLD,
        "attempts": 3,
    }
    p = limits(groups={"off": False}, max_age=timedelta(minutes=2))
    for fix, reason in fixes:
        assert decide(candidate(**broken), SILENT, p).reason is reason, fix
        broken.update(fix)

    assert decide(candidate(**broken), SILENT, p).action is Action.RECOVER


@pytest.mark.parametrize(
    "content_type",
    [
        pytest.param(None, id="none"),
        pytest.param("", id="blank"),
        pytest.param("application/x-python-serialize", id="pickle"),
        pytest.param("text/plain", id="unlisted"),
        pytest.param("APPLICATION/JSON", id="case-differs"),
    ],
)
def test_an_orphan_whose_message_is_not_plain_data_is_never_sent_again(content_type: str | None) -> None:
    decision = decide(candidate(content_type=content_type), SILENT, limits())

    assert decision.action is Action.MARK_TERMINAL
    assert decision.reason is Reason.UNSAFE_MESSAGE
    assert (content_type or "untyped") in decision.detail


@pytest.mark.parametrize("content_type", sorted(SAFE_CONTENT_TYPES))
def test_an_orphan_whose_message_is_plain_data_is_recovered(content_type: str) -> None:
    decision = decide(candidate(content_type=content_type), SILENT, limits())

    assert decision.action is Action.RECOVER


@pytest.mark.parametrize(
    ("overrides", "policy_overrides"),
    [
        pytest.param({"group": "reports"}, {"groups": {"reports": True}}, id="group-switched-on"),
        pytest.param(
            {"group": "reports"}, {"groups": {"other": False}}, id="group-missing-from-mapping-is-on"
        ),
        pytest.param({"group": None}, {"groups": {"reports": False}}, id="no-group"),
        pytest.param({"attempts": 2}, {}, id="one-below-policy-cap"),
        pytest.param({"attempts": 3, "max_attempts": 5}, {}, id="own-higher-cap-wins"),
        pytest.param({"attempts": 4, "max_attempts": 5}, {"max_attempts": 1}, id="own-cap-over-lower-policy"),
        pytest.param({"started_at": OLD}, {"max_age": None}, id="no-age-limit"),
        pytest.param(
            {"started_at": OLD}, {"max_age": timedelta(minutes=5)}, id="exactly-as-old-as-the-age-limit"
        ),
        pytest.param({"started_at": OLD}, {"max_age": timedelta(days=1)}, id="younger-than-the-age-limit"),
    ],
)
def test_an_orphan_within_its_limits_is_recovered(
    overrides: dict[str, Any], policy_overrides: dict[str, Any]
) -> None:
    c = candidate(**overrides)
    p = limits(**policy_overrides)
    decision = decide(c, SILENT, p)

    cap = c.max_attempts or p.max_attempts
    assert decision == Decision(
        TASK,
        Action.RECOVER,
        Reason.RECOVERABLE,
        Evidence.LEASE_LAPSED,
        f"recovery {c.attempts + 1} of {cap}",
        c.attempts + 1,
    )
    assert decision.orphaned


@pytest.mark.parametrize(
    ("boot", "view", "evidence"),
    [
        pytest.param(None, ANSWERED_EMPTY, Evidence.WORKER_ANSWERED_WITHOUT_TASK, id="answered-without-it"),
        pytest.param(BOOT, AT_BOOT_EMPTY, Evidence.FOUND_AT_BOOT, id="its-own-next-boot-lacks-it"),
        pytest.param(
            BOOT,
            WorkerView(replied=False, fresh_boots=frozenset({"boot-b"})),
            Evidence.LEASE_LAPSED,
            id="own-boot-lapsed-while-a-new-boot-runs",
        ),
        pytest.param(None, SILENT, Evidence.NO_REPLY_NO_LEASE, id="no-boot-no-lease"),
    ],
)
def test_a_recovery_carries_the_evidence_that_proved_the_owner_gone(
    boot: str | None, view: WorkerView, evidence: Evidence
) -> None:
    decision = decide(candidate(boot=boot), view, limits())

    assert decision.action is Action.RECOVER
    assert decision.evidence is evidence
    assert decision.orphaned


def test_a_row_without_a_ledger_entry_is_recovered_from_nothing_never() -> None:
    # A row alone names no boot; if no lease lives under its node it is an orphan, but the message is gone.
    decision = decide(candidate(boot=None, has_entry=False), SILENT, limits())

    assert decision.action is Action.MARK_TERMINAL
    assert decision.reason is Reason.NO_LEDGER_ENTRY
    assert decision.evidence is Evidence.NO_REPLY_NO_LEASE


def test_a_row_only_task_of_a_worker_cut_off_from_its_ledger_is_left_once_it_answers_holding_it() -> None:
    # Fail open: the worker holds no lease, but it answers the broadcast, and its answer decides.
    view = WorkerView(replied=True, held=frozenset({TASK}), asked=frozenset({TASK}))

    decision = decide(candidate(boot=None, has_entry=False), view, limits())

    assert decision.action is Action.LEAVE
    assert decision.evidence is Evidence.WORKER_HOLDS_TASK


@pytest.mark.parametrize(
    ("alive", "gone", "exited", "asked"),
    [
        pytest.param({"a"}, set(), set(), True, id="live-boot"),
        pytest.param({"b"}, {"a"}, {"a"}, True, id="live-boot-beside-an-exited-one"),
        pytest.param(set(), set(), set(), True, id="no-boot-recorded"),
        pytest.param(set(), {"a"}, set(), True, id="lease-lapsed-as-a-cut-off-worker-s-does"),
        pytest.param(set(), {"a", "b"}, {"a"}, True, id="one-lapsed-one-exited"),
        pytest.param(set(), {"a"}, {"a"}, False, id="every-boot-seen-to-exit"),
    ],
)
def test_a_node_is_asked_unless_every_boot_of_it_was_seen_to_exit(
    alive: set[str], gone: set[str], exited: set[str], asked: bool
) -> None:
    assert worth_asking(frozenset(alive), frozenset(gone), frozenset(exited)) is asked


@pytest.mark.parametrize(
    ("overrides", "asked"),
    [
        pytest.param({"boot": None, "has_entry": False}, True, id="row-only-past-grace"),
        pytest.param({}, False, id="its-entry-names-its-boot"),
        pytest.param({"boot": None, "started_at": NOW - GRACE / 2}, False, id="in-grace"),
        pytest.param({"boot": None, "task_known": False}, False, id="not-registered-here"),
        pytest.param({"boot": None, "task_name": ""}, False, id="no-task-name"),
        pytest.param({"boot": None, "started_at": None}, False, id="no-start-time"),
        pytest.param({"boot": None, "worker": ""}, False, id="no-worker"),
        pytest.param({"boot": None, "problem": "unreadable entry"}, False, id="unreadable"),
    ],
)
def test_a_node_is_asked_only_about_a_row_only_task_its_answer_can_decide(
    overrides: dict[str, Any], asked: bool
) -> None:
    c = candidate(**overrides)
    assert asks_about(c, NOW, GRACE) is asked
    if not asked and c.boot is None:
        # A row-only task not asked about is one no answer decides: the same decision, silent or not.
        decisions = {decide(c, view, limits()) for view in (SILENT, HOLDS, ANSWERED_EMPTY)}
        assert len(decisions) == 1


# --- a lost pool process ---------------------------------------------------------------------------


def test_a_task_whose_pool_process_died_is_recovered_at_once() -> None:
    # The worker watched its pool process die, so neither grace nor liveness applies.
    decision = after_pool_loss(candidate(started_at=NOW, attempts=1), limits())

    assert decision == Decision(
        TASK, Action.RECOVER, Reason.RECOVERABLE, Evidence.POOL_CHILD_LOST, "recovery 2 of 3", 2
    )
    assert decision.orphaned


@pytest.mark.parametrize(
    ("overrides", "action", "reason"),
    [
        pytest.param({"attempts": 3}, Action.MARK_TERMINAL, Reason.LIMIT_REACHED, id="cap-reached"),
        pytest.param(
            {"attempts": 1, "max_attempts": 1}, Action.MARK_TERMINAL, Reason.LIMIT_REACHED, id="own-cap"
        ),
        pytest.param({"group": "off"}, Action.MARK_TERMINAL, Reason.GROUP_DISABLED, id="group-off"),
        pytest.param(
            {"content_type": "application/x-python-serialize"},
            Action.MARK_TERMINAL,
            Reason.UNSAFE_MESSAGE,
            id="pickle",
        ),
        pytest.param(
            {"row_status": "SUCCESS"}, Action.FORGET, Reason.ALREADY_FINISHED, id="already-finished"
        ),
    ],
)
def test_a_pool_loss_obeys_the_same_limits_as_a_sweep(
    overrides: dict[str, Any], action: Action, reason: Reason
) -> None:
    decision = after_pool_loss(candidate(**overrides), limits(groups={"off": False}))

    assert (decision.action, decision.reason, decision.evidence) == (action, reason, Evidence.POOL_CHILD_LOST)


# --- a broker's redelivery, counted by the ledger ------------------------------------------------


def test_a_counted_redelivery_is_recorded_as_the_next_recovery() -> None:
    decision = after_redelivery(candidate(attempts=1), limits(), limit_reached=False)

    assert decision == Decision(
        TASK,
        Action.RECOVER,
        Reason.RECOVERABLE,
        Evidence.BROKER_REDELIVERED,
        "recovery 2 of 3, delivered again by the broker",
        2,
    )
    assert decision.orphaned


@pytest.mark.parametrize("max_attempts", [None, 2])
def test_a_redelivery_at_the_cap_marks_the_task_terminal(max_attempts: int | None) -> None:
    cap = max_attempts or 3
    decision = after_redelivery(
        candidate(attempts=cap, max_attempts=max_attempts), limits(), limit_reached=True
    )

    assert decision == Decision(
        TASK,
        Action.MARK_TERMINAL,
        Reason.LIMIT_REACHED,
        Evidence.BROKER_REDELIVERED,
        f"already recovered {cap} of {cap} times",
        cap,
    )


# --- a cap an operator lifted ------------------------------------------------------------------------


@pytest.mark.parametrize("max_attempts", [None, 1])
def test_a_lifted_cap_recovers_the_orphan_exactly_once_more(max_attempts: int | None) -> None:
    cap = max_attempts or 3
    capped = candidate(attempts=cap, max_attempts=max_attempts)
    assert decide(capped, SILENT, limits()).reason is Reason.LIMIT_REACHED  # not before the lift

    lifted = dataclasses.replace(capped, lifted=cap + 1)
    decision = decide(lifted, SILENT, limits())

    assert (decision.action, decision.reason, decision.attempt) == (
        Action.RECOVER,
        Reason.RECOVERABLE,
        cap + 1,
    )
    assert decision.detail == f"recovery {cap + 1} of {cap + 1} (its cap lifted by an operator)"
    # Lost again after that one recovery: marked terminal at the lifted count.
    again = decide(dataclasses.replace(lifted, attempts=cap + 1), SILENT, limits())
    assert (again.action, again.reason, again.detail) == (
        Action.MARK_TERMINAL,
        Reason.LIMIT_REACHED,
        f"already recovered {cap + 1} of {cap + 1} times",
    )


def test_a_lifted_cap_is_recovered_though_the_boot_its_entry_names_is_alive_and_in_grace() -> None:
    # A pool process died under it: its worker lives on, and was the one that marked it terminal.
    alive = WorkerView(replied=True, fresh_boots=frozenset({BOOT}))
    lifted = candidate(attempts=3, lifted=4, started_at=NOW - timedelta(seconds=1))
    assert decide(dataclasses.replace(lifted, lifted=0), alive, limits()).reason is Reason.IN_GRACE

    decision = decide(lifted, alive, limits())

    assert (decision.action, decision.evidence) == (Action.RECOVER, Evidence.CAP_LIFTED)
    assert decision.orphaned
    # Once that recovery is made (the count reaches the lift), the task is judged as any other.
    assert decide(dataclasses.replace(lifted, attempts=4), alive, limits()).reason is Reason.IN_GRACE


def test_a_lift_below_a_cap_raised_since_changes_nothing() -> None:
    decision = decide(candidate(attempts=2, lifted=2), SILENT, limits(max_attempts=5))

    assert (decision.action, decision.detail) == (Action.RECOVER, "recovery 3 of 5")


def test_a_lifted_cap_governs_a_pool_loss_and_a_redelivery_too() -> None:
    lifted = candidate(attempts=3, lifted=4)

    assert after_pool_loss(lifted, limits()).action is Action.RECOVER
    assert after_redelivery(lifted, limits(), limit_reached=False).detail == (
        "recovery 4 of 4, delivered again by the broker"
    )


# --- the per-sweep recovery limit -------------------------------------------------------------------


def _recover(task_id: str) -> Decision:
    return Decision(
        task_id, Action.RECOVER, Reason.RECOVERABLE, Evidence.NO_REPLY_NO_LEASE, "recovery 1 of 3", 1
    )


def _other(task_id: str, action: Action) -> Decision:
    return Decision(task_id, action, Reason.LIMIT_REACHED, Evidence.NO_REPLY_NO_LEASE, "", 3)


def test_recoveries_over_the_per_sweep_limit_are_deferred_in_order() -> None:
    decisions = [
        _recover("a"),
        _other("b", Action.MARK_TERMINAL),
        _recover("c"),
        _other("d", Action.FORGET),
        _recover("e"),
        _recover("f"),
    ]

    kept = defer_excess(decisions, 2)

    assert [d.task_id for d in kept] == ["a", "b", "c", "d", "e", "f"]
    assert kept[:4] == decisions[:4]  # other actions neither count nor change
    for deferred in kept[4:]:
        assert (deferred.action, deferred.reason) == (Action.LEAVE, Reason.DEFERRED)
        assert deferred.evidence is Evidence.NO_REPLY_NO_LEASE
        assert "limit of 2" in deferred.detail


def test_a_zero_limit_defers_every_recovery_and_no_limit_none() -> None:
    decisions = [_recover("a"), _other("b", Action.MARK_TERMINAL), _recover("c")]

    assert [d.action for d in defer_excess(decisions, 0)] == [
        Action.LEAVE,
        Action.MARK_TERMINAL,
        Action.LEAVE,
    ]
    assert defer_excess(decisions, None) == decisions
    assert defer_excess(decisions, 2) == decisions
    assert defer_excess([], 1) == []


# --- decide: a recovery already sent ---------------------------------------------------------------


@pytest.mark.parametrize("view", [SILENT, ANSWERED_EMPTY, HOLDS, None])
@pytest.mark.parametrize("attempts", [1, 3])
def test_an_entry_already_sent_again_is_only_recorded_whatever_its_worker_says(
    view: WorkerView | None, attempts: int
) -> None:
    # At the cap too: the copy already sent is the task's last recovery, not one more.
    c = candidate(sent_again=True, attempts=attempts, started_at=NOW)

    decision = decide(c, view, limits(max_attempts=3))

    assert (decision.action, decision.reason) == (Action.RECOVER, Reason.ALREADY_SENT)
    assert decision.attempt == attempts
    assert not decision.orphaned  # an operator's "mark terminal" never fences the copy already sent


def test_an_entry_already_sent_is_never_deferred_nor_counted_against_the_limit() -> None:
    sent = decide(candidate(task_id="s", sent_again=True, attempts=1), SILENT, limits())
    decisions = [sent, _recover("a"), _recover("b")]

    kept = defer_excess(decisions, 1)

    assert [(d.action, d.reason) for d in kept] == [
        (Action.RECOVER, Reason.ALREADY_SENT),
        (Action.RECOVER, Reason.RECOVERABLE),
        (Action.LEAVE, Reason.DEFERRED),
    ]


# --- invariants over every combination ------------------------------------------------------------


VIEWS = [
    HOLDS,
    ANSWERED_EMPTY,
    AT_BOOT_HOLDS,
    AT_BOOT_EMPTY,
    AT_BOOT_TWIN,
    WorkerView(replied=False, fresh_boots=frozenset({BOOT})),
    WorkerView(replied=False, fresh_boots=frozenset({"boot-b"})),
    SILENT,
    GONE,
    EXITED,
    None,
]
UNJUDGEABLE = [{"problem": "unreadable"}, {"worker": None}, {"task_name": None}, {"task_known": False}]
YOUNG = [NOW - GRACE / 2, NOW, NOW + CLOCK_TOLERANCE]
FUTURE = [NOW + CLOCK_TOLERANCE * 2, NOW + timedelta(days=1)]
ALIVE_EVIDENCE = {Evidence.WORKER_HOLDS_TASK, Evidence.NO_REPLY_LEASE_FRESH}
CAP = 3
INVARIANT_POLICIES = [
    limits(max_attempts=CAP, groups={"on": True, "off": False}, max_age=max_age)
    for max_age in (None, timedelta(minutes=1), NOW - OLD)
]


def test_no_combination_acts_on_a_record_it_cannot_judge_or_a_task_in_grace() -> None:
    gates = [(record, OLD) for record in UNJUDGEABLE] + [({}, None)] + [({}, young) for young in YOUNG]
    gates += [({}, future) for future in FUTURE]
    axes = itertools.product(gates, [BOOT, None], [None, "STARTED", "SUCCESS"], [True, False], VIEWS)
    for (record, started), boot, status, entry, view in axes:
        c = candidate(started_at=started, boot=boot, row_status=status, has_entry=entry, **record)
        d = decide(c, view, INVARIANT_POLICIES[0])

        boot_gone = boot is not None and view is not None and boot in view.gone_boots
        if record or started is None or (started > NOW + CLOCK_TOLERANCE and not boot_gone):
            assert d.action is Action.REPORT, (c, view, d)
            assert d.evidence is Evidence.NONE, (c, view, d)
        elif boot_gone:
            # The one exception: the boot its ledger entry names is known gone, so no record of it is
            # still being written, and its start time, by whatever clock, does not matter.
            assert d.evidence in (Evidence.LEASE_LAPSED, Evidence.PROCESS_EXITED), (c, view, d)
        else:
            assert (d.action, d.reason) == (Action.LEAVE, Reason.IN_GRACE), (c, view, d)
            assert d.evidence is Evidence.NONE, (c, view, d)


def _check_judged(c: Candidate, view: WorkerView | None, p: Limits, d: Decision) -> None:
    """What must hold of every decision on a readable task outside its grace period."""
    assert c.started_at is not None
    evidence = judge(c, view or SILENT)
    cap = c.max_attempts or p.max_attempts
    too_old = p.max_age is not None and c.started_at < p.now - p.max_age
    recoverable_now = (
        c.recoverable
        and c.group != "off"
        and c.has_entry
        and c.content_type in SAFE_CONTENT_TYPES
        and not too_old
        and c.attempts < cap
    )

    assert d.task_id == c.task_id
    assert d.evidence is evidence
    assert d.orphaned is (evidence in ORPHAN_EVIDENCE)
    if evidence in ALIVE_EVIDENCE:
        assert (d.action, d.reason) == (Action.LEAVE, Reason.ALIVE)
    if d.action in {Action.RECOVER, Action.MARK_TERMINAL, Action.FORGET}:
        assert evidence in ORPHAN_EVIDENCE
    if d.action is Action.RECOVER:
        assert c.recoverable
        assert c.has_entry
        assert c.attempts < cap
        assert c.group != "off"
        assert c.content_type in SAFE_CONTENT_TYPES
        assert not too_old
        assert c.row_status not in READY_STATES
        assert d.attempt == c.attempts + 1
        assert d.attempt <= cap
    if d.action is Action.FORGET:
        assert c.row_status in READY_STATES
    if evidence in ORPHAN_EVIDENCE and c.row_status not in READY_STATES:
        assert d.action is (Action.RECOVER if recoverable_now else Action.MARK_TERMINAL)


def test_every_judged_combination_keeps_the_safety_invariants() -> None:
    axes = itertools.product(
        [OLD, NOW - GRACE],  # started: long ago, or exactly at the end of the grace period
        [BOOT, None],  # boot
        [None, "STARTED", "SUCCESS", "REVOKED"],  # row_status
        [True, False],  # has_entry
        [True, False],  # recoverable
        [None, "off", "unlisted"],  # group
        [0, CAP - 1, CAP, CAP + 2],  # attempts
        [None, 1, CAP + 2],  # the task's own cap
        ["application/json", "application/x-python-serialize", None],  # content_type
        INVARIANT_POLICIES,
        VIEWS,
    )
    seen: set[tuple[Action, Reason]] = set()
    for started, boot, status, entry, rec, group, attempts, own, ctype, p, view in axes:
        c = candidate(
            started_at=started,
            boot=boot,
            row_status=status,
            has_entry=entry,
            recoverable=rec,
            group=group,
            attempts=attempts,
            max_attempts=own,
            content_type=ctype,
        )
        d = decide(c, view, p)
        seen.add((d.action, d.reason))
        try:
            _check_judged(c, view, p, d)
        except AssertionError as exc:
            raise AssertionError(f"{c}\n{view}\n{p}\n-> {d}") from exc

    # Every outcome of a judgement was reached, so the invariants were not checked against nothing.
    assert seen == {
        (Action.LEAVE, Reason.ALIVE),
        (Action.FORGET, Reason.ALREADY_FINISHED),
        (Action.MARK_TERMINAL, Reason.NOT_RECOVERABLE),
        (Action.MARK_TERMINAL, Reason.GROUP_DISABLED),
        (Action.MARK_TERMINAL, Reason.NO_LEDGER_ENTRY),
        (Action.MARK_TERMINAL, Reason.UNSAFE_MESSAGE),
        (Action.MARK_TERMINAL, Reason.TOO_OLD),
        (Action.MARK_TERMINAL, Reason.LIMIT_REACHED),
        (Action.RECOVER, Reason.RECOVERABLE),
    }


def test_decisions_are_values() -> None:
    decision = decide(candidate(), SILENT, limits())

    assert decision == decide(candidate(), SILENT, limits())
    with pytest.raises(dataclasses.FrozenInstanceError):
        decision.action = Action.LEAVE  # type: ignore[misc]
