"""A worker's validity (worker/validity.py), in this process: until when a boot's executions hold, that an
answer after that instant does not revive them, and that the deadline thread gives them up by the clock
alone, with no Redis anywhere."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from celery_orphans.conf import FORFEIT_LATENCY_SECONDS
from celery_orphans.worker import clock, forfeit
from celery_orphans.worker.validity import Validity
from tests.helpers import wait_for


@pytest.fixture(autouse=True)
def shared_validity() -> Iterator[None]:
    """Put the shared validity back as it was: it is this process's own."""
    before = forfeit._validity[0], forfeit._validity[1]
    yield
    forfeit._validity[0], forfeit._validity[1] = before


class Stops:
    """Records what a given-up generation stopped and which boot was given up."""

    def __init__(self) -> None:
        self.generations: list[int] = []
        self.boots: list[str] = []

    def stop(self, generation: int) -> int:
        self.generations.append(generation)
        return 1

    def validity(self) -> Validity:
        return Validity("v@test", "boot-1", self.stop, self.boots.append)


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
