"""The in-flight ledger against a real Redis: its Lua scripts, its fence, and how it reads entries back."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import Any

import pytest
import redis

from celery_orphans import scripts
from celery_orphans.entry import (
    Entry,
)
from celery_orphans.ledger import Admission, Fence, Ledger, Terms
from celery_orphans.recovery.claims import ALL_RETRIES
from celery_orphans.scripts import ClaimMode
from celery_orphans.store import Keys, client
from tests.factories import work_entry
from tests.helpers import wait_for


def admit(ledger: Ledger, entry: Entry, releases: Sequence[tuple[str, str]] = ()) -> bool:
    """Record ``entry``, as a worker's checked write does; ``False`` means its copy is stale."""
    return ledger.admit_delivery(entry, releases).admitted


TTL = 3600


def claim(
    ledger: Ledger, task_id: str, mode: str, *, token: str = "", attempts: int = 0, retries: int = 0
) -> Any:
    return ledger.claim(
        task_id, token=token, attempts=attempts, retries=retries, ttl=TTL, mode=ClaimMode(mode)
    )


def inflight(ledger: Ledger) -> set[str]:
    return set(ledger.older_than(float("inf")))


# --- admit, load, release -------------------------------------------------------------------------


def test_admit_records_the_entry_and_indexes_it_as_in_flight(ledger: Ledger) -> None:
    e = work_entry("t")

    assert admit(ledger, e) is True

    assert ledger.load(["t"]) == {"t": e}
    assert ledger.load(["t"])["t"].token == e.token  # type: ignore[union-attr]
    assert inflight(ledger) == {"t"}
    assert ledger.count() == 1


def test_load_answers_none_for_a_task_without_an_entry(ledger: Ledger) -> None:
    ledger.admit_delivery(work_entry("t"))

    assert ledger.load(["t", "absent"])["absent"] is None
    assert ledger.load([]) == {}


def test_release_with_the_writing_token_removes_the_entry_and_its_index(ledger: Ledger) -> None:
    e = work_entry("t")
    ledger.admit_delivery(e)

    assert ledger.release("t", e.token) is True

    assert ledger.load(["t"]) == {"t": None}
    assert inflight(ledger) == set()


def test_release_with_another_token_removes_nothing(ledger: Ledger) -> None:
    e = work_entry("t")
    ledger.admit_delivery(e)

    assert ledger.release("t", "not-the-token") is False
    assert ledger.release("t", "") is False

    assert ledger.load(["t"]) == {"t": e}
    assert inflight(ledger) == {"t"}


def test_a_newer_execution_survives_the_release_of_an_older_one(ledger: Ledger) -> None:
    older, newer = work_entry("t"), work_entry("t", recorded_at=2000.0)
    ledger.admit_delivery(older)
    ledger.admit_delivery(newer)  # the same task delivered again, e.g. restored by the transport

    assert ledger.release("t", older.token) is False

    assert ledger.load(["t"]) == {"t": newer}
    assert inflight(ledger) == {"t"}


def test_releasing_an_absent_entry_is_a_no_op(ledger: Ledger) -> None:
    assert ledger.release("absent", "token") is False


def test_release_many_removes_only_the_entries_still_carrying_their_token(ledger: Ledger) -> None:
    a, b, newer_b = work_entry("a"), work_entry("b"), work_entry("b")
    ledger.admit_delivery(a)
    ledger.admit_delivery(b)
    ledger.admit_delivery(newer_b)  # b delivered again since its release was queued

    assert ledger.release_many([("a", a.token), ("b", b.token)]) == 1
    assert ledger.load(["a", "b"]) == {"a": None, "b": newer_b}
    assert inflight(ledger) == {"b"}


def test_an_admit_carries_the_releases_of_finished_tasks(ledger: Ledger) -> None:
    done, rewritten, rewritten_again = work_entry("done"), work_entry("again"), work_entry("again")
    ledger.admit_delivery(done)
    ledger.admit_delivery(rewritten)
    ledger.admit_delivery(rewritten_again)
    following = work_entry("next")

    admitted = admit(ledger, following, [("done", done.token), ("again", rewritten.token)])

    assert admitted
    assert ledger.load(["done", "again", "next"]) == {
        "done": None,
        "again": rewritten_again,
        "next": following,
    }
    assert inflight(ledger) == {"again", "next"}


def test_an_admit_removes_the_released_entry_of_the_same_task_before_writing_the_new_one(
    ledger: Ledger,
) -> None:
    first, redelivered = work_entry("t"), work_entry("t")
    ledger.admit_delivery(first)

    assert ledger.admit_delivery(redelivered, [("t", first.token)])
    assert ledger.load(["t"]) == {"t": redelivered}
    assert inflight(ledger) == {"t"}


def test_a_refused_copy_still_carries_its_releases(ledger: Ledger) -> None:
    done = work_entry("done")
    ledger.admit_delivery(done)
    claim(ledger, "t", "terminal")

    admitted = admit(ledger, work_entry("t"), [("done", done.token)])

    assert not admitted
    assert ledger.load(["done", "t"]) == {"done": None, "t": None}


def test_an_admit_tells_whether_the_task_has_a_checkpoint(ledger: Ledger, redis_client: redis.Redis) -> None:
    first = ledger.admit_delivery(work_entry("t"))
    assert (first.admitted, first.checkpoint) == (True, False)
    redis_client.hset(Keys.current().checkpoint("t"), "value", "1")

    second = ledger.admit_delivery(work_entry("t"))
    assert (second.admitted, second.checkpoint) == (True, True)


def test_load_with_fences_reads_entries_and_fences_in_chunks(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("celery_orphans.ledger.LOAD_CHUNK", 2)
    entries = {task_id: work_entry(task_id) for task_id in ("a", "b", "c")}
    for e in entries.values():
        ledger.admit_delivery(e)
    claim(ledger, "b", "recover", token=entries["b"].token)

    ledger.mark_sent("b", entries["b"].token)

    loaded, fences = ledger.load_with_fences(["a", "b", "c", "absent"])

    assert loaded == {**entries, "absent": None}
    assert fences == {
        "a": Fence(),
        "b": Fence(attempts=1, claimed=entries["b"].token, sent=entries["b"].token),
        "c": Fence(),
        "absent": Fence(),
    }


def test_older_than_lists_only_entries_recorded_before_the_cutoff(ledger: Ledger) -> None:
    for task_id, at in [("a", 100.0), ("b", 200.0), ("c", 300.0)]:
        ledger.admit_delivery(work_entry(task_id, recorded_at=at))

    assert sorted(ledger.older_than(250.0)) == ["a", "b"]
    assert ledger.older_than(99.0) == []
    assert sorted(ledger.older_than(1e12)) == ["a", "b", "c"]


def test_older_than_forgets_a_released_entry(ledger: Ledger) -> None:
    e = work_entry("a", recorded_at=100.0)
    ledger.admit_delivery(e)
    ledger.release("a", e.token)

    assert ledger.older_than(1e12) == []


def test_older_than_uses_the_latest_admission(ledger: Ledger) -> None:
    ledger.admit_delivery(work_entry("a", recorded_at=100.0))
    ledger.admit_delivery(work_entry("a", recorded_at=500.0))

    assert ledger.older_than(250.0) == []


# --- claim and the fence --------------------------------------------------------------------------


def test_attempts_are_zero_before_any_recovery(ledger: Ledger) -> None:
    ledger.admit_delivery(work_entry("t"))

    assert ledger.attempts(["t", "never-seen"]) == {"t": 0, "never-seen": 0}
    assert ledger.attempts([]) == {}


def test_a_recover_claim_counts_the_attempt_and_keeps_the_entry_until_the_resend_is_out(
    ledger: Ledger,
) -> None:
    e = work_entry("t", retries=2)
    ledger.admit_delivery(e)

    assert claim(ledger, "t", "recover", token=e.token, attempts=0, retries=2) == 1
    assert ledger.attempts(["t"]) == {"t": 1}
    assert ledger.load(["t"]) == {"t": e}  # released by the caller once the message is published
    assert inflight(ledger) == {"t"}

    again = work_entry("t", retries=2, attempt=1)
    ledger.admit_delivery(again)
    assert claim(ledger, "t", "recover", token=again.token, attempts=1, retries=2) == 2
    assert ledger.attempts(["t"]) == {"t": 2}


def test_a_claim_is_refused_when_the_entry_was_replaced(ledger: Ledger) -> None:
    observed, replaced = work_entry("t"), work_entry("t")
    ledger.admit_delivery(observed)
    ledger.admit_delivery(replaced)  # a worker picked the task up after the sweep looked

    for mode in ("recover", "terminal", "forget"):
        assert claim(ledger, "t", mode, token=observed.token) is None

    assert ledger.attempts(["t"]) == {"t": 0}
    assert ledger.load(["t"]) == {"t": replaced}


def test_a_claim_is_refused_when_the_entry_appeared_or_vanished(ledger: Ledger) -> None:
    e = work_entry("t")
    ledger.admit_delivery(e)
    assert claim(ledger, "t", "terminal", token="") is None  # observed absent, now present

    ledger.release("t", e.token)
    assert claim(ledger, "t", "recover", token=e.token) is None  # observed present, now gone
    assert ledger.attempts(["t"]) == {"t": 0}


def test_a_claim_is_refused_when_the_attempt_count_moved(ledger: Ledger) -> None:
    e = work_entry("t")
    ledger.admit_delivery(e)
    assert claim(ledger, "t", "recover", token=e.token, attempts=0) == 1

    for mode in ("recover", "terminal", "forget"):
        assert claim(ledger, "t", mode, token=e.token, attempts=0) is None

    assert ledger.attempts(["t"]) == {"t": 1}
    assert ledger.load(["t"]) == {"t": e}


def test_of_concurrent_claims_on_one_observation_exactly_one_wins(ledger: Ledger) -> None:
    e = work_entry("t")
    ledger.admit_delivery(e)
    contenders = 8
    barrier = threading.Barrier(contenders)
    results: list[int | None] = []
    lock = threading.Lock()

    def contend() -> None:
        barrier.wait()
        result = ledger.claim("t", token=e.token, attempts=0, retries=0, ttl=TTL, mode=ClaimMode.RECOVER)
        with lock:
            results.append(result)

    threads = [threading.Thread(target=contend) for _ in range(contenders)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)

    assert sorted(results, key=lambda r: r is not None) == [None] * (contenders - 1) + [1]
    assert ledger.attempts(["t"]) == {"t": 1}


@pytest.mark.parametrize("mode", ["recover", "terminal"])
def test_a_claim_that_raises_the_fence_gives_it_the_requested_ttl(
    ledger: Ledger, redis_client: redis.Redis, mode: str
) -> None:
    e = work_entry("t")
    ledger.admit_delivery(e)

    ledger.claim("t", token=e.token, attempts=0, retries=0, ttl=1234, mode=ClaimMode(mode))

    assert 1233 <= redis_client.ttl(ledger.keys.fence("t")) <= 1234


def test_a_recover_claim_fences_off_older_copies_of_the_same_retry(ledger: Ledger) -> None:
    e = work_entry("t", retries=1)
    ledger.admit_delivery(e)
    claim(ledger, "t", "recover", token=e.token, retries=1)
    first = work_entry("t", retries=1, attempt=1)
    ledger.admit_delivery(first)  # the first recovery ran, and its worker died in turn
    claim(ledger, "t", "recover", token=first.token, attempts=1, retries=1)  # recovered twice: n = 2

    assert admit(ledger, work_entry("t", retries=1)) is False  # the caller's original message
    assert admit(ledger, work_entry("t", retries=1, attempt=1)) is False  # the first recovery's message
    assert (
        admit(ledger, work_entry("t", retries=0, attempt=2)) is False
    )  # an earlier retry, however recovered
    assert admit(ledger, work_entry("t", retries=1, attempt=2)) is True  # the current recovery
    assert admit(ledger, work_entry("t", retries=1, attempt=3)) is True
    assert admit(ledger, work_entry("t", retries=2)) is True  # the task retried itself since: a new message


def test_reading_the_fence_alone_finds_the_same_copies_stale_as_the_admission(ledger: Ledger) -> None:
    # A worker that cannot write an entry (no lease held, writes refused) still drops overtaken copies.
    e = work_entry("t", retries=1)
    assert ledger.stale(e) is False  # no fence yet
    ledger.admit_delivery(e)
    claim(ledger, "t", "recover", token=e.token, retries=1)
    copies = [(1, None), (1, 1), (0, 2), (1, 2), (2, None)]

    found = [ledger.stale(work_entry("t", retries=r, attempt=a)) for r, a in copies]

    assert found == [True, False, True, False, False]
    assert found == [not admit(ledger, work_entry("t", retries=r, attempt=a)) for r, a in copies]
    claim(ledger, "t", "terminal", token=ledger.load(["t"])["t"].token, attempts=1, retries=ALL_RETRIES)
    assert ledger.stale(work_entry("t", retries=5, attempt=9)) is True


def test_a_refused_copy_leaves_the_current_entry_alone(ledger: Ledger) -> None:
    e = work_entry("t")
    ledger.admit_delivery(e)
    claim(ledger, "t", "recover", token=e.token)
    current = work_entry("t", attempt=1)
    ledger.admit_delivery(current)

    assert admit(ledger, work_entry("t")) is False

    assert ledger.load(["t"]) == {"t": current}


def test_a_terminal_claim_removes_the_entry_and_fences_off_every_copy(ledger: Ledger) -> None:
    e = work_entry("t", retries=3)
    ledger.admit_delivery(e)

    assert claim(ledger, "t", "terminal", token=e.token, retries=ALL_RETRIES) == 0

    assert ledger.load(["t"]) == {"t": None}
    assert inflight(ledger) == set()
    for retries, attempt in [
        (0, None),
        (3, None),
        (3, 5),
        (4, None),
        (1000, 0),
        (ALL_RETRIES - 1, 9),
        (ALL_RETRIES, 9),
    ]:
        assert admit(ledger, work_entry("t", retries=retries, attempt=attempt)) is False, (
            retries,
            attempt,
        )
    assert ledger.load(["t"]) == {"t": None}


def test_a_terminal_claim_keeps_the_recovery_count(ledger: Ledger) -> None:
    e = work_entry("t")
    ledger.admit_delivery(e)
    claim(ledger, "t", "recover", token=e.token)
    recovered = work_entry("t", attempt=1)
    ledger.admit_delivery(recovered)

    assert claim(ledger, "t", "terminal", token=recovered.token, attempts=1, retries=ALL_RETRIES) == 1
    assert ledger.attempts(["t"]) == {"t": 1}


def test_a_terminal_claim_works_for_a_task_with_no_entry(ledger: Ledger) -> None:
    # A STARTED row without a ledger entry: the sweep observed no token.
    assert claim(ledger, "t", "terminal", token="", retries=ALL_RETRIES) == 0

    assert admit(ledger, work_entry("t")) is False


def test_a_forget_claim_removes_the_entry_and_raises_no_fence(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    e = work_entry("t", retries=2)
    ledger.admit_delivery(e)

    assert claim(ledger, "t", "forget", token=e.token, retries=ALL_RETRIES) == 0

    assert ledger.load(["t"]) == {"t": None}
    assert inflight(ledger) == set()
    assert redis_client.exists(ledger.keys.fence("t")) == 0
    assert admit(ledger, work_entry("t", retries=2)) is True


def test_a_forget_claim_leaves_an_existing_fence_as_it_was(ledger: Ledger, redis_client: redis.Redis) -> None:
    e = work_entry("t")
    ledger.admit_delivery(e)
    claim(ledger, "t", "recover", token=e.token)
    fence = redis_client.hgetall(ledger.keys.fence("t"))
    ledger.unclaim("t", e.token)  # as a recovery that sent nothing does

    assert claim(ledger, "t", "forget", token=e.token, attempts=1, retries=ALL_RETRIES) == 1

    assert redis_client.hgetall(ledger.keys.fence("t")) == fence
    assert admit(ledger, work_entry("t")) is False  # still fenced against the pre-recovery copy


def test_keys_live_under_the_configured_prefix(redis_client: redis.Redis, settings: Any) -> None:
    settings.CELERY_ORPHANS_KEY_PREFIX = "other_prefix"
    ledger = Ledger(client(), Keys.current())
    e = work_entry("t")
    ledger.admit_delivery(e)
    claim(ledger, "t", "recover", token=e.token)

    keys = {k.decode() for k in redis_client.keys("*")}

    assert keys == {"other_prefix:entry:t", "other_prefix:inflight", "other_prefix:fence:t"}


# --- the delivery ---------------------------------------------------------------------------------


def test_a_recover_claim_records_which_entry_it_claimed_and_sending_records_it_sent(ledger: Ledger) -> None:
    e = work_entry("t")
    ledger.admit_delivery(e)

    assert claim(ledger, "t", "recover", token=e.token) == 1
    assert ledger.load_with_fences(["t"])[1]["t"] == Fence(attempts=1, claimed=e.token, sent=None)
    ledger.mark_sent("t", e.token)

    _, fence = ledger.load_with_fences(["t", "never-seen"])
    assert fence == {"t": Fence(attempts=1, claimed=e.token, sent=e.token), "never-seen": Fence()}
    assert fence["t"].sent_again(e)
    assert not fence["never-seen"].sent_again(e)


def test_an_entry_already_sent_is_never_claimed_for_recovery_again(ledger: Ledger) -> None:
    e = work_entry("t")
    ledger.admit_delivery(e)
    claim(ledger, "t", "recover", token=e.token)
    ledger.mark_sent("t", e.token)

    assert claim(ledger, "t", "recover", token=e.token, attempts=1) is None
    assert ledger.attempts(["t"]) == {"t": 1}
    # Once the sweep that sent it lets go (it did not commit), finishing its bookkeeping is allowed and
    # changes nothing in Redis by itself but the hold of the sweep that finishes it.
    assert claim(ledger, "t", "complete", token=e.token, attempts=1) is None
    assert ledger.unclaim("t", e.token)
    assert claim(ledger, "t", "complete", token=e.token, attempts=1) == 1
    assert claim(ledger, "t", "complete", token=e.token, attempts=1) is None
    assert ledger.load(["t"]) == {"t": e}


def test_completing_is_refused_for_an_entry_the_latest_recovery_did_not_claim(ledger: Ledger) -> None:
    e = work_entry("t")
    ledger.admit_delivery(e)

    assert claim(ledger, "t", "complete", token=e.token) is None  # never claimed
    claim(ledger, "t", "recover", token=e.token)
    newer = work_entry("t", attempt=1)
    ledger.admit_delivery(newer)  # the copy sent again started: its entry is not the claimed one
    assert claim(ledger, "t", "complete", token=newer.token, attempts=1) is None


def test_a_recover_claim_keeps_other_sweeps_off_the_entry_until_lifted(ledger: Ledger) -> None:
    e = work_entry("t")
    ledger.admit_delivery(e)
    assert claim(ledger, "t", "recover", token=e.token, attempts=0) == 1

    # A sweep that looked after the claim sees the same token and the new count: still refused.
    for mode in ("recover", "terminal", "forget"):
        assert claim(ledger, "t", mode, token=e.token, attempts=1) is None
    assert ledger.attempts(["t"]) == {"t": 1}

    assert ledger.unclaim("t", e.token)
    assert claim(ledger, "t", "recover", token=e.token, attempts=1) == 2


def test_a_recover_claim_lapses_so_a_dead_claimers_task_is_judged_again(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    e = work_entry("t")
    ledger.admit_delivery(e)
    monkeypatch.setattr(scripts, "CLAIM_SECONDS", 1)
    assert claim(ledger, "t", "recover", token=e.token, attempts=0) == 1
    assert claim(ledger, "t", "recover", token=e.token, attempts=1) is None

    wait_for(lambda: claim(ledger, "t", "recover", token=e.token, attempts=1) == 2, 10, "the claim to lapse")


def test_a_claim_on_an_older_entry_does_not_hold_off_the_one_that_replaced_it(ledger: Ledger) -> None:
    e = work_entry("t")
    ledger.admit_delivery(e)
    assert claim(ledger, "t", "recover", token=e.token, attempts=0) == 1
    recovered = work_entry("t", attempt=1)
    ledger.admit_delivery(recovered)  # a worker runs the recovered copy, then dies in turn

    assert claim(ledger, "t", "recover", token=recovered.token, attempts=1) == 2
    assert not ledger.unclaim("t", e.token)


# --- a broker's redelivery of an orphan, counted by the admit -------------------------------------
CAP = 3
COUNTED = Terms(cap=CAP, ttl=TTL)  # as a worker admits a delivery of a recoverable task


def redeliver(ledger: Ledger, e: Entry, releases: list[tuple[str, str]] | None = None) -> Admission:
    """Admit ``e`` as a worker does; the entry it replaced is checked on its own."""
    return dataclasses.replace(ledger.admit_delivery(e, releases or [], terms=COUNTED), previous=None)


def test_a_copy_that_replaces_the_unreleased_entry_of_the_same_copy_counts_as_a_recovery(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    lost, again = work_entry("t"), work_entry("t", recorded_at=2000.0)
    assert redeliver(ledger, lost) == Admission(admitted=True, attempts=0)

    assert redeliver(ledger, again) == Admission(admitted=True, attempts=1, redelivered=True)

    assert ledger.attempts(["t"]) == {"t": 1}
    assert ledger.load(["t"]) == {"t": again}
    assert 0 < redis_client.ttl(Keys.current().fence("t")) <= TTL


def test_a_counted_redelivery_names_the_entry_it_replaced(ledger: Ledger) -> None:
    lost = dataclasses.replace(work_entry("t"), node="celery@dead-host")
    ledger.admit_delivery(lost, terms=COUNTED)

    admission = ledger.admit_delivery(work_entry("t"), terms=COUNTED)

    assert admission.previous == dataclasses.replace(lost, token="")
    assert ledger.admit_delivery(work_entry("t", retries=1), terms=COUNTED).previous is None


def test_a_counted_redelivery_stays_the_current_copy_and_is_counted_each_time_it_is_lost(
    ledger: Ledger,
) -> None:
    lost = work_entry("t")
    redeliver(ledger, lost)
    claim(ledger, "t", "recover", token=lost.token)  # the copy with attempt 1 was sent: n = 1
    previous = work_entry("t", attempt=1)
    assert redeliver(ledger, previous) == Admission(admitted=True, attempts=1)

    for attempts in (2, 3):
        again = work_entry("t", attempt=1)  # the broker delivers the same message again, headers and all
        assert redeliver(ledger, again) == Admission(admitted=True, attempts=attempts, redelivered=True)
        previous = again

    assert ledger.load(["t"]) == {"t": previous}
    assert admit(ledger, work_entry("t")) is False  # the caller's original is still stale


def test_a_redelivery_at_the_cap_is_admitted_uncounted_for_the_worker_to_mark_terminal(
    ledger: Ledger,
) -> None:
    redeliver(ledger, work_entry("t"))
    for _ in range(CAP):
        redeliver(ledger, work_entry("t"))
    last = work_entry("t")

    assert redeliver(ledger, last) == Admission(admitted=True, attempts=CAP, limit_reached=True)

    assert ledger.attempts(["t"]) == {"t": CAP}
    assert ledger.load(["t"]) == {"t": last}  # the terminal claim takes it by this token
    assert claim(ledger, "t", "terminal", token=last.token, attempts=CAP) == CAP
    assert redeliver(ledger, work_entry("t")) == Admission(admitted=False, attempts=CAP)


def test_a_copy_is_not_counted_when_the_entry_it_replaces_was_released_in_the_same_call(
    ledger: Ledger,
) -> None:
    finished = work_entry("t")
    redeliver(ledger, finished)

    assert redeliver(ledger, work_entry("t"), [("t", finished.token)]) == Admission(admitted=True, attempts=0)


def test_a_copy_is_not_counted_without_a_cap_or_without_an_entry_to_replace(ledger: Ledger) -> None:
    assert redeliver(ledger, work_entry("t")).redelivered is False  # nothing to replace
    assert ledger.admit_delivery(work_entry("t")) == Admission(admitted=True, attempts=0)  # no cap: as before

    assert ledger.attempts(["t"]) == {"t": 0}


def test_a_retry_that_replaces_the_entry_of_the_execution_that_retried_is_not_counted(ledger: Ledger) -> None:
    redeliver(ledger, work_entry("t", retries=0))  # its release is still on its way when the retry starts

    assert redeliver(ledger, work_entry("t", retries=1)) == Admission(admitted=True, attempts=0)


def test_a_copy_sent_by_a_recovery_is_not_counted_again_when_it_replaces_the_recovered_entry(
    ledger: Ledger,
) -> None:
    lost = work_entry("t")
    redeliver(ledger, lost)
    claim(ledger, "t", "recover", token=lost.token)  # a sweep (or pool loss) counted it and sends it

    # The broker's copy of the original lost the race: stale, neither run nor counted.
    assert redeliver(ledger, work_entry("t")) == Admission(admitted=False, attempts=1)
    # The copy the recovery sent starts before the claimer released the entry it replaces.
    assert redeliver(ledger, work_entry("t", attempt=1)) == Admission(admitted=True, attempts=1)


def test_a_sweep_that_observed_the_lost_entry_cannot_claim_it_once_a_redelivery_was_counted(
    ledger: Ledger,
) -> None:
    lost = work_entry("t")
    redeliver(ledger, lost)
    redeliver(ledger, work_entry("t"))

    for mode in ("recover", "terminal", "forget"):
        assert claim(ledger, "t", mode, token=lost.token, attempts=0) is None
    assert ledger.attempts(["t"]) == {"t": 1}


def test_a_recovery_after_a_counted_redelivery_fences_off_the_redelivered_copy(ledger: Ledger) -> None:
    redeliver(ledger, work_entry("t"))
    again = work_entry("t")
    redeliver(ledger, again)  # counted: n = 1, the copy with attempt 0 is still the current one
    assert claim(ledger, "t", "recover", token=again.token, attempts=1) == 2  # lost again, a sweep sends it

    # Restored later by the Redis transport after its visibility timeout: dropped, not counted.
    assert redeliver(ledger, work_entry("t")) == Admission(admitted=False, attempts=2)
    assert redeliver(ledger, work_entry("t", attempt=2)) == Admission(admitted=True, attempts=2)


def test_an_entry_written_without_its_copy_is_never_taken_for_a_redelivery(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    older = work_entry("t")
    redis_client.hset(Keys.current().entry("t"), mapping={"token": older.token, "entry": older.to_json()})

    assert redeliver(ledger, work_entry("t")) == Admission(admitted=True, attempts=0)


# --- the cap: the message kept, the cap lifted ----------------------------------------------------


def capped(ledger: Ledger) -> Entry:
    """A task recovered once and then marked terminal at its cap of 1: the message of its last copy kept."""
    lost = work_entry("t")
    ledger.admit_delivery(lost)
    claim(ledger, "t", "recover", token=lost.token)
    last = work_entry("t", attempt=1)
    ledger.admit_delivery(last)
    kept = ledger.claim(
        "t", token=last.token, attempts=1, retries=ALL_RETRIES, ttl=TTL, mode=ClaimMode.TERMINAL, keep=True
    )
    assert kept == 1
    return last


def test_a_terminal_mark_at_the_cap_keeps_the_message_where_no_sweep_or_release_reaches_it(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    last = capped(ledger)

    key = Keys.current().entry("t")
    assert float(redis_client.hget(key, "capped") or 0) == 1000.0  # its place on the index, for the lift
    assert 0 < redis_client.ttl(key) <= TTL  # kept as long as the fence, no longer
    assert inflight(ledger) == set()
    assert ledger.release("t", last.token) is False
    assert ledger.release_many([("t", last.token)]) == 0
    assert ledger.admit_delivery(work_entry("u"), [("t", last.token)]).admitted
    assert ledger.hand_back("t", last.token) is False
    assert redis_client.exists(key) == 1
    for retries, attempt in [(0, None), (0, 1), (0, 5), (7, 0)]:
        assert admit(ledger, work_entry("t", retries=retries, attempt=attempt)) is False
    assert ledger.load_with_fences(["t"])[1]["t"].attempts == 1


def test_lifting_the_cap_gives_the_kept_message_back_to_the_sweeps_for_one_recovery_more(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    last = capped(ledger)

    lifted = ledger.lift("t")

    assert (lifted.lifted, lifted.attempts) == (True, 1)
    assert inflight(ledger) == {"t"}
    assert ledger.older_than(1000.0) == ["t"]  # back at its own place: as old as it was
    # Under a token of its own: a release queued for the capped delivery, landing now, takes nothing.
    lifted_token = f"{last.token}~2"
    assert ledger.load(["t"]) == {"t": dataclasses.replace(last, token=lifted_token)}
    assert ledger.release("t", last.token) is False
    assert ledger.release_many([("t", last.token)]) == 0
    assert ledger.hand_back("t", last.token) is False
    # Kept, with the lifted cap, until the sweep's recovery, however long that takes.
    assert redis_client.ttl(Keys.current().entry("t")) == -1
    assert redis_client.ttl(Keys.current().fence("t")) == -1
    assert ledger.load_with_fences(["t"])[1]["t"].lifted == 2
    # Until the sweep's recovery, every copy is still stale: only the one it sends runs.
    assert admit(ledger, work_entry("t", attempt=1)) is False
    assert claim(ledger, "t", "recover", token=lifted_token, attempts=1) == 2
    assert 0 < redis_client.ttl(Keys.current().fence("t")) <= TTL  # the recovery's window, as any
    assert admit(ledger, work_entry("t", attempt=2)) is True
    assert ledger.lift("t").done == 0  # not terminal now: nothing to lift


def test_after_the_one_recovery_a_lift_allows_a_redelivery_is_at_the_cap_again(ledger: Ledger) -> None:
    last = capped(ledger)
    ledger.lift("t")
    assert claim(ledger, "t", "recover", token=f"{last.token}~2", attempts=1) == 2
    sent = work_entry("t", attempt=2)
    assert ledger.admit_delivery(sent, terms=Terms(cap=1, ttl=TTL)) == Admission(admitted=True, attempts=2)

    # Its worker dies and the broker delivers that copy again: the cap the admission applies is the
    # lifted one (2), and it was used: the worker marks it terminal instead of running it.
    again = ledger.admit_delivery(work_entry("t", attempt=2), terms=Terms(cap=1, ttl=TTL))

    assert (again.admitted, again.attempts, again.limit_reached, again.redelivered) == (True, 2, True, False)


def test_a_lifted_cap_counts_a_redelivery_the_plain_cap_would_stop(
    ledger: Ledger, redis_client: redis.Redis
) -> None:
    lost = work_entry("t")
    ledger.admit_delivery(lost, terms=Terms(cap=1, ttl=TTL))
    redis_client.hset(
        Keys.current().fence("t"), mapping={"attempts": 1, "lifted": 2, "retries": 0, "copy": 0}
    )

    again = ledger.admit_delivery(work_entry("t"), terms=Terms(cap=1, ttl=TTL))

    assert (again.admitted, again.attempts, again.redelivered, again.limit_reached) == (True, 2, True, False)


def test_a_lift_is_refused_without_a_terminal_fence_or_without_a_kept_message(ledger: Ledger) -> None:
    running = work_entry("t")
    ledger.admit_delivery(running)
    assert ledger.lift("t").done == 0  # running: not terminal
    assert inflight(ledger) == {"t"}

    claim(ledger, "t", "terminal", token=running.token, retries=ALL_RETRIES)  # not at the cap: not kept
    assert ledger.lift("t").done == -1

    assert admit(ledger, work_entry("t", retries=1)) is False  # still terminal
    assert ledger.lift("never-seen").done == 0


def test_an_entry_is_never_written_under_a_boot_whose_lease_lapsed(ledger: Ledger) -> None:
    """A write held up by the network lands after its boot's lease lapsed: no entry may name that boot,
    which the sweep judges gone while its worker runs the task unprotected."""
    e = work_entry("t")
    lease = ledger.keys.lease(e.node, e.boot)

    late = ledger.admit_delivery(e, terms=Terms(lease=lease))

    assert (late.writer_gone, late.admitted) == (True, False)
    assert not ledger.client.exists(ledger.keys.entry("t"))

    ledger.client.set(lease, b"1", px=10_000)
    assert ledger.admit_delivery(e, terms=Terms(lease=lease)).admitted
    # A record whose last renewal still holds keeps a boot alive as it does for the sweep.
    ledger.client.delete(lease, ledger.keys.entry("t"))
    ledger.client.hset(ledger.keys.boots(e.node), e.boot, f"1:{2**50}")
    assert ledger.admit_delivery(e, terms=Terms(lease=lease)).admitted


def test_a_write_that_reaches_redis_after_its_hand_back_mark_writes_nothing(ledger: Ledger) -> None:
    """A waiting admission's write held up on its way to Redis, its connection closed when no answer came,
    reaches Redis after its worker marked the message handed back (finding no entry yet) and gave it back.
    Written, it would name the worker's live boot, unmarked, and every delivery of the copy would be
    dropped as its duplicate: the task would never run while that worker lives. The mark makes its token
    void."""
    held = work_entry("t")
    lease = ledger.keys.lease(held.node, held.boot)
    ledger.client.set(lease, b"1", px=10_000)  # the writing boot is alive throughout
    single_flight = Terms(lease=lease, single_flight=True)

    fence = ledger.keys.fence("t")
    ledger.client.hset(fence, "attempts", 1)
    ledger.client.expire(fence, 5)  # a recovery's count, about to lapse
    assert ledger.hand_back("t", held.token) is False  # the mark finds no entry: nothing to mark
    assert 86_000 < ledger.client.ttl(fence) <= 86_400  # kept ATTEMPTS_WINDOW_SECONDS from the mark

    late = ledger.admit_delivery(held, terms=single_flight)
    assert (late.given_back, late.writer_gone, late.admitted) == (True, False, False)
    assert not ledger.client.exists(ledger.keys.entry("t"))
    # The copy, delivered to a peer (or to the same worker, with a token of its own), is admitted.
    again = work_entry("t")
    assert ledger.admit_delivery(again, terms=single_flight).admitted
    # The held write reaching Redis after the copy's admission changes nothing either.
    assert ledger.admit_delivery(held, terms=single_flight).given_back
    assert ledger.load(["t"]) == {"t": again}


def test_a_write_that_reaches_redis_after_its_entry_was_marked_does_not_unmark_it(ledger: Ledger) -> None:
    """The same write sent twice (its first answer lost, the message given back unmarked while Redis
    refused the mark, then delivered to the same worker again) may land after a mark that did find the
    entry: it must not write the entry over without its mark."""
    written = work_entry("t")
    lease = ledger.keys.lease(written.node, written.boot)
    ledger.client.set(lease, b"1", px=10_000)
    ledger.admit_delivery(written, terms=Terms(lease=lease))

    assert ledger.hand_back("t", written.token) is True
    assert ledger.admit_delivery(written, terms=Terms(lease=lease, single_flight=True)).given_back
    assert ledger.client.hexists(ledger.keys.entry("t"), "handed_back")
