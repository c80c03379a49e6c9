"""Where the benchmarks place their trials (benchmarks/interleave.py): pure, no services."""

from __future__ import annotations

import random
from datetime import datetime, timedelta

import pytest

from benchmarks.interleave import charged_rates, spread, thue_morse

T0 = datetime(2026, 1, 1)


def test_thue_morse_order_balances_every_position_and_any_drift_up_to_its_degree() -> None:
    order = thue_morse(32)

    assert order.startswith("abbabaabbaababba")
    assert order.count("a") == order.count("b") == 16
    positions = {c: [i for i, x in enumerate(order) if x == c] for c in "ab"}
    for degree in range(5):  # 2**5 blocks: every drift up to the 4th power weighs on both sets alike
        assert sum(i**degree for i in positions["a"]) == sum(i**degree for i in positions["b"])


def test_thue_morse_order_needs_a_block() -> None:
    with pytest.raises(ValueError, match="at least one block"):
        thue_morse(0)


def finishes(process: str, *blocks_and_seconds: tuple[int, float]) -> list[tuple[int, datetime, str]]:
    """One pool process's tasks, each as (block, finished at T0 + seconds, process)."""
    return [(block, T0 + timedelta(seconds=s), process) for block, s in blocks_and_seconds]


def test_each_gap_is_charged_to_the_set_of_the_task_that_ends_it() -> None:
    # Block 0 is the untimed lead-in; 1 is "plain", 2 is "ours". Two pool processes, listed out of order.
    finished = finishes("p1", (2, 0.30), (0, 0.0), (1, 0.10), (2, 0.42)) + finishes(
        "p2", (0, 0.05), (1, 0.15), (2, 0.27)
    )

    rates = charged_rates(finished, {1: "plain", 2: "ours"})

    # plain: p1 0.10 s and p2 0.10 s for 2 tasks; ours: p1 0.20 + 0.12 and p2 0.12 s for 3 tasks.
    assert rates["plain"] == pytest.approx(2 * 2 / 0.20)
    assert rates["ours"] == pytest.approx(2 * 3 / 0.44)


def test_a_first_task_of_a_process_and_untimed_blocks_are_charged_to_no_set() -> None:
    finished = finishes("p1", (1, 0.0), (2, 0.1), (3, 0.5), (1, 0.6))  # block 3 is the lead-out

    rates = charged_rates(finished, {1: "plain", 2: "ours"})

    assert rates == {"plain": pytest.approx(1 / 0.1), "ours": pytest.approx(1 / 0.1)}


def test_a_set_that_was_charged_nothing_is_an_error_not_a_zero_division() -> None:
    with pytest.raises(ValueError, match="no time was charged to ours"):
        charged_rates(finishes("p1", (0, 0.0), (1, 0.1)), {1: "plain", 2: "ours"})


def test_spread_puts_one_moment_in_each_nth_of_the_interval_in_a_seeded_random_order() -> None:
    moments = spread(8, 5.0, random.Random(1))

    assert sorted(int(m // (5.0 / 8)) for m in moments) == list(range(8))
    assert moments != sorted(moments)
    assert moments == spread(8, 5.0, random.Random(1))


@pytest.mark.parametrize(("n", "interval"), [(0, 5.0), (3, 0.0)])
def test_spread_refuses_nothing_to_spread(n: int, interval: float) -> None:
    with pytest.raises(ValueError, match="cannot spread"):
        spread(n, interval, random.Random(1))
