"""A worker's validity (worker/validity.py), in this process: until when a boot's executions hold, that an
answer after that instant does not revive them, and that the deadline thread gives them up by the clock
alone, with no Redis anywhere."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from celery.concurrency import get_implementation

from celery_orphans.conf import FORFEIT_LATENCY_SECONDS
from celery_orphans.worker import clock, forfeit, validity
from celery_orphans.worker.validity import Validity
from tests.helpers import wait_for

pytestmark = pytest.mark.usefixtures("shared_validity")


class Stops:
    """Records what a given-up generation stopped and which boot was given up."""

    def __init__(self) -> None:
        self.generations: list[int] = []
        self.boots: list[str] = []

    def stop(self, generation: int) -> int:
        self.generations.append(generation)
        return 1

    def validity(self, **kwargs: Any) -> Validity:
        return Validity("v@test", "boot-1", self.stop, self.boots.append, **kwargs)


def test_an_answered_renewal_holds_from_when_it_was_sent() -> None:
    validity = Stops().validity()
    sent = clock.now()

    assert validity.extend(1, sent, 60)

    assert validity.valid_until == sent + 60
    assert forfeit.holds(1) and validity.current() == ("boot-1", 1, True)


def test_an_answer_that_comes_after_the_validity_ran_out_does_not_revive_it() -> None:
    stops = Stops()
    validity = stops.validity()
    validity.extend(1, clock.now() - 10, 5)  # ran out 5 s ago, and nothing gave it up yet

    assert not validity.extend(1, clock.now(), 60)

    assert validity.generation == 2 and not forfeit.holds(1) and not forfeit.holds(2)
    assert (stops.generations, stops.boots) == ([1], ["boot-1"])
    assert validity.boot != "boot-1" and validity.current()[2] is False


def test_a_renewal_answered_for_a_generation_given_up_meanwhile_extends_nothing() -> None:
    validity = Stops().validity()
    validity.extend(1, clock.now(), 60)
    validity.lapse(1, "its lease is gone from Redis")

    assert not validity.extend(1, clock.now(), 60)
    assert validity.valid_until == 0.0


def test_the_deadline_gives_the_boot_up_at_the_instant_by_the_clock_alone() -> None:
    stops = Stops()
    validity = stops.validity()
    validity.start()
    try:
        validity.extend(1, clock.now(), 0.3)
        until = validity.valid_until
        wait_for(lambda: stops.generations == [1], 5, "the deadline to give the boot up", interval=0.005)
        late = clock.now() - until
    finally:
        validity.stop()

    assert late < FORFEIT_LATENCY_SECONDS + 0.1, late
    assert not forfeit.holds(1)


def test_expire_leaves_a_generation_that_still_holds() -> None:
    stops = Stops()
    validity = stops.validity()
    validity.extend(1, clock.now(), 60)

    assert not validity.expire()
    assert stops.generations == [] and forfeit.holds(1)


# The solo and threads pools cannot stop a running execution: the instant passing gives nothing up there.


def test_where_executions_cannot_be_stopped_the_instant_asks_for_a_renewal_and_gives_nothing_up() -> None:
    stops, asked = Stops(), threading.Event()
    validity = stops.validity(stoppable=False, on_expired=asked.set)
    validity.start()
    try:
        validity.extend(1, clock.now(), 0.2)
        assert asked.wait(5), "the instant passing asked for no renewal"
    finally:
        validity.stop()

    assert stops.generations == [] and validity.generation == 1 and not forfeit.holds(1)


def test_where_executions_cannot_be_stopped_a_renewal_that_found_the_lease_makes_them_hold_again() -> None:
    stops = Stops()
    validity = stops.validity(stoppable=False)
    validity.extend(1, clock.now() - 10, 5)  # ran out 5 s ago: a stall

    assert validity.extend(1, clock.now(), 60)

    assert forfeit.holds(1) and stops.generations == []


def test_where_executions_cannot_be_stopped_a_renewal_that_failed_gives_them_up() -> None:
    stops = Stops()
    validity = stops.validity(stoppable=False)
    validity.extend(1, clock.now() - 10, 5)

    assert validity.expire()

    assert stops.generations == [1] and not forfeit.holds(1)


@pytest.mark.parametrize("answer", ["held again", "given up"])
def test_an_ending_execution_waits_for_the_answer_where_the_clock_gives_nothing_up(answer: str) -> None:
    validity = Stops().validity(stoppable=False)
    validity.extend(1, clock.now() - 10, 5)
    settle = {"held again": lambda: validity.extend(1, clock.now(), 60), "given up": validity.expire}[answer]
    timer = threading.Timer(0.2, settle)
    timer.start()
    try:
        assert forfeit.settled(1, timeout=5) is (answer == "held again")
    finally:
        timer.cancel()


def test_an_ending_execution_does_not_wait_where_the_clock_gives_executions_up() -> None:
    validity = Stops().validity()
    validity.extend(1, clock.now() - 10, 5)
    begun = clock.now()

    assert not forfeit.settled(1, timeout=5)
    assert clock.now() - begun < 0.1


@pytest.mark.parametrize(
    ("pool", "stoppable"),
    [("prefork", True), ("gevent", True), ("eventlet", True), ("solo", False), ("threads", False)],
)
def test_which_pools_can_stop_a_running_execution(pool: str, stoppable: bool) -> None:
    assert validity.stoppable(pool) is stoppable
    if pool in ("prefork", "solo", "threads"):  # the green pools' modules need their event loops
        assert validity.stoppable(get_implementation(pool)) is stoppable
