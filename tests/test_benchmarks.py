"""Where the benchmarks place their trials (benchmarks/interleave.py) and how they read their figures
(benchmarks/figures.py): pure, no services."""

from __future__ import annotations

import random
from datetime import datetime, timedelta

import pytest

from benchmarks.figures import counters, per_task, ready_at
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


def accounts(cpu: float, bytes_in: float, bytes_out: float, **calls: tuple[int, int]) -> dict[str, float]:
    """Redis's counters as ``counters`` reads them from INFO: calls and usec per command."""
    return counters(
        {f"cmdstat_{name.replace('__', '|')}": {"calls": n, "usec": us} for name, (n, us) in calls.items()},
        {"used_cpu_sys": cpu / 4, "used_cpu_user": 3 * cpu / 4},
        {"total_net_input_bytes": bytes_in, "total_net_output_bytes": bytes_out},
    )


def test_a_task_costs_what_redis_counted_between_two_readings_but_not_the_readings() -> None:
    before = accounts(10.0, 1_000, 500, info=(3, 30), evalsha=(100, 1_000), hget=(100, 50))
    # 2,000 tasks: one script call each, running HGET, DEL and ZADD inside; two INFO readings between.
    after = accounts(
        10.05,
        3_801_000,
        42_500,
        info=(5, 50),
        evalsha=(2_100, 23_000),
        hget=(2_100, 1_050),
        zadd=(2_000, 900),
        **{"del": (4_000, 1_200)},
    )

    cost = per_task(before, after, 2_000)

    assert cost["tasks_per_core_second"] == pytest.approx(40_000)
    assert cost["redis_cpu_us_per_task"] == pytest.approx(25)
    assert cost["executing_us_per_task"] == pytest.approx(11)  # the script's time holds its commands'
    assert cost["calls_per_task"] == 1
    assert cost["commands_per_task"] == 5  # the call and the four commands it ran
    assert cost["by_command"] == {"del": 2, "evalsha": 1, "hget": 1, "zadd": 1}
    assert cost["bytes_in_per_task"] == 1_900
    assert cost["bytes_out_per_task"] == 21


def test_without_scripts_every_command_is_a_call() -> None:
    after = accounts(1.0, 2_000, 1_000, lpush=(10, 20), brpop=(10, 40), multi=(20, 0), exec=(20, 60))

    cost = per_task(accounts(0.5, 0, 0), after, 10)

    assert cost["calls_per_task"] == cost["commands_per_task"] == 6
    assert cost["executing_us_per_task"] == 12


def test_no_task_is_an_error_not_a_zero_division() -> None:
    with pytest.raises(ValueError, match="no task"):
        per_task(accounts(0, 0, 0), accounts(1, 1, 1), 0)


def test_ready_is_read_from_the_workers_ready_line_in_local_time() -> None:
    log = (
        "[2026-11-26 03:57:01,834: INFO/MainProcess] celery-orphans: worker gone, sweeping now\n"
        "[2026-11-26 03:57:01,841: INFO/MainProcess] p1@bench ready.\n"
        "[2026-11-26 03:57:02,879: INFO/MainProcess] Task demoapp.summarize[x] received\n"
    )

    assert ready_at(log) == pytest.approx(datetime(2026, 11, 26, 3, 57, 1, 841_000).timestamp())
    with pytest.raises(ValueError, match="no ready line"):
        ready_at(log.replace(" ready.", " starting"))
