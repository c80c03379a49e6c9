"""Where the benchmarks place their trials.

How the throughput benchmark (P4) interleaves two sets of tasks in one queue and rates each set, and
when the recovery benchmark (P2) kills its workers. Pure functions, kept apart from the benchmarks'
workers and databases so they can be tested alone.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterable, Mapping
from datetime import datetime


def thue_morse(length: int) -> str:
    """``abbabaab...``: each letter holds every position equally often, over any power-of-two prefix.

    A speed that drifts across the sequence (linearly, quadratically, or by a polynomial of higher
    degree, up to the log2 of its length minus one) weighs on the "a" blocks and the "b" blocks alike.
    """
    if length < 1:
        raise ValueError(f"a Thue-Morse order needs at least one block, not {length}")
    order = "a"
    while len(order) < length:
        order += order.translate(str.maketrans("ab", "ba"))
    return order[:length]


def charged_rates(
    finished: Iterable[tuple[int, datetime, str]], timed: Mapping[int, str]
) -> dict[str, float]:
    """Tasks per second of each set, from ``(block, date_done, pool process)`` of every task of a trial.

    Each pool process's time from the end of one task to the end of its next is charged to the set of
    the block that next task belongs to, if that block is timed (``timed`` maps it to its set): that time
    holds the wait for the worker's main process to fetch, admit and hand over the task, and no time is
    left between two sets. A set's rate is its tasks over the time charged to it, times the number of
    pool processes: the rate of a worker that ran that set alone.
    """
    by_process: dict[str, list[tuple[datetime, int]]] = {}
    for block, done, process in finished:
        by_process.setdefault(process, []).append((done, block))
    sets = sorted(set(timed.values()))
    seconds = dict.fromkeys(sets, 0.0)
    counts = dict.fromkeys(sets, 0)
    for ends in by_process.values():
        ends.sort()
        for (before, _), (done, block) in itertools.pairwise(ends):
            if block in timed:
                seconds[timed[block]] += (done - before).total_seconds()
                counts[timed[block]] += 1
    missing = [s for s in sets if not counts[s] or seconds[s] <= 0]
    if missing:
        raise ValueError(f"no time was charged to {', '.join(missing)}: too few tasks, or one pool process")
    return {s: len(by_process) * counts[s] / seconds[s] for s in sets}


def spread(n: int, interval: float, rng: random.Random) -> list[float]:
    """``n`` moments of ``interval``, one at random in each n-th of it, in a random order.

    Fewer draws than plain uniform ones cover the whole interval: eight kills spread this way meet
    every part of a sweep interval, where eight uniform draws often leave a quarter of it out.
    """
    if n < 1 or interval <= 0:
        raise ValueError(f"cannot spread {n} moments over {interval} s")
    slots = list(range(n))
    rng.shuffle(slots)
    return [(slot + rng.random()) * interval / n for slot in slots]
