"""Removing finished tasks' ledger entries off the worker's path: carried by the next write, or flushed."""

from __future__ import annotations

import uuid

import redis

from celery_orphans.ledger import Entry, Ledger
from celery_orphans.releases import Releaser
from celery_orphans.store import Keys, client
from tests.test_ledger import entry
from tests.workers import wait_for


def admitted(ledger: Ledger, task_id: str) -> Entry:
    e = entry(task_id, token=uuid.uuid4().hex)
    ledger.admit(e)
    return e


def test_a_queued_release_is_flushed_by_the_thread_when_no_write_carries_it(
    redis_client: redis.Redis,
) -> None:
    ledger = Ledger(client(), Keys.current())
    e = admitted(ledger, "t")
    releaser = Releaser()

    releaser.release(ledger, "t", e.token)

    wait_for(lambda: ledger.load(["t"])["t"] is None, 5, "the entry to be removed")
    assert ledger.count() == 0


def test_take_hands_the_queued_releases_to_one_writer_only(redis_client: redis.Redis) -> None:
    ledger = Ledger(client(), Keys.current())
    releaser = Releaser(delay=60)  # the thread stays out of the way
    releaser.release(ledger, "a", "token-a")
    releaser.release(ledger, "b", "token-b")

    assert releaser.take(ledger) == [("a", "token-a"), ("b", "token-b")]
    assert releaser.take(ledger) == []
    assert releaser.flush() == 0


def test_releases_given_back_after_a_failed_write_are_flushed_first(redis_client: redis.Redis) -> None:
    ledger = Ledger(client(), Keys.current())
    first, second = admitted(ledger, "first"), admitted(ledger, "second")
    releaser = Releaser(delay=60)
    releaser.release(ledger, "second", second.token)
    taken = releaser.take(ledger)
    releaser.release(ledger, "first", first.token)

    releaser.give_back(ledger, taken)

    assert releaser.take(ledger) == [("second", second.token), ("first", first.token)]
