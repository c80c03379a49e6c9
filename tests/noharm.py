"""The scenarios of the differential "no harm" suite and what is observed of each (tests/test_no_harm.py).

Each scenario sends ordinary Celery work (testproject/demoapp/noharm.py) and, once it has settled, is
observed the same way with and without celery-orphans: the state of every id its results reach, what
``AsyncResult.get()`` gave, which executions ran (by task name, from the tasks' own records, counted
under their root id), and the audit rows celery-orphans wrote about those ids.
"""

from __future__ import annotations

import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone
from typing import Any

from celery import chain, chord, group
from celery.exceptions import CPendingDeprecationWarning
from celery.result import AsyncResult, GroupResult, ResultBase
from django_celery_results.models import TaskResult

from celery_orphans.models import OrphanEvent
from tests.helpers import wait_for

S = 2.2  # how long each body runs: long enough for Beat's sweep (every second) to look at it twice
READY = {"SUCCESS", "FAILURE", "REVOKED"}


@dataclass
class Scenario:
    name: str  # the feature it exercises
    send: Callable[[], ResultBase]
    get: bool = True  # whether AsyncResult.get() returns (not for Ignore, ignore_result, ...)
    runs: int = 1  # executions to wait for when it does not
    after: Callable[[ResultBase], None] | None = None  # what the caller does once it is sent
    pools: frozenset[str] | None = None  # where it applies (None: every pool)
    audited: int = 0  # audit rows kept on purpose with celery-orphans (docs/supported.md)
    sent: ResultBase | None = field(default=None, repr=False)


def _started(result: ResultBase) -> None:
    wait_for(lambda: TaskResult.objects.filter(task_id=result.id, status="STARTED").exists(), 300, "a start")


def _revoke(terminate: bool) -> Callable[[ResultBase], None]:
    def act(result: ResultBase) -> None:
        _started(result)
        result.revoke(terminate=terminate)  # type: ignore[attr-defined]

    return act


def scenarios() -> list[Scenario]:
    from demoapp import noharm as t

    past = datetime.now(dt_timezone.utc) - timedelta(seconds=5)
    found = [
        Scenario(f"replace into {shape}", lambda shape=shape: t.replace_me.delay(shape, S))
        for shape in ("chain", "group", "chord", "plain", "nested:chain", "nested:group")
    ]
    return [
        *found,
        Scenario("replace inside a chain", lambda: chain(t.replace_me.si("chain", S), t.step.s(seconds=S))()),
        Scenario("chain", lambda: chain(t.step.si(1, S), t.step.s(seconds=S))()),
        Scenario("group", lambda: group(t.step.si(1, S), t.step.si(2, S)).apply_async()),
        Scenario("chord", lambda: chord([t.step.si(1, S), t.step.si(2, S)], t.total.s())()),
        Scenario(
            "chord with a failing member and link_error",
            lambda: chord([t.step.si(1, S), t.fail.si(S)], t.total.s()).on_error(t.errback.s())(),
        ),
        Scenario("link_error", lambda: t.fail.apply_async((S,), link_error=t.errback.s())),
        Scenario("retry with countdown", lambda: t.retry.delay(0.2, S)),
        Scenario("retry without countdown", lambda: t.retry.delay(None, S)),
        Scenario("Ignore", lambda: t.ignore.delay(S), get=False),
        Scenario("Reject with requeue", lambda: t.reject.delay(True, S)),
        Scenario("Reject without requeue", lambda: t.reject.delay(False, S), get=False),
        Scenario("soft time limit", lambda: t.soft_limit.delay(S)),
        Scenario("hard time limit", lambda: t.hard_limit.delay(S)),
        Scenario("expires", lambda: t.step.apply_async((0, S), expires=past), get=False, runs=0),
        Scenario("countdown", lambda: t.step.apply_async((0, S), countdown=1)),
        Scenario(
            "revoke before it runs",
            lambda: t.step.apply_async((0, S), countdown=2),
            get=False,
            runs=0,
            after=lambda r: r.revoke(),
        ),
        Scenario("revoke while it runs", lambda: t.step.delay(0, 2 * S), after=_revoke(False)),
        Scenario(
            "revoke terminate=True", lambda: t.step.delay(0, 2 * S), get=False, runs=0, after=_revoke(True)
        ),
        Scenario("acks_late=False", lambda: t.early_ack.delay(S)),
        Scenario("task_track_started off", lambda: t.untracked.delay(S)),
        Scenario("ignore_result", lambda: t.no_result.delay(S), get=False),
        Scenario("rate limit", lambda: group(t.limited.si(S) for _ in range(3)).apply_async()),
        Scenario(
            "task_retry_on_worker_lost",
            lambda: t.lose_pool_process.delay(),
            pools=frozenset({"prefork", "spawn"}),
            audited=1,  # the extension, not Celery, sends it again: one audit row says so
        ),
    ]


def ids_of(result: ResultBase | None) -> list[str]:
    """Every id a result reaches: itself, its parents, a group's members, in a fixed order."""
    if result is None:
        return []
    found = [result.id] if result.id else []
    if isinstance(result, GroupResult):
        for child in result.results:
            found += ids_of(child)
    found += ids_of(getattr(result, "parent", None))
    return list(dict.fromkeys(found))


def settle(scenario: Scenario, timeout: float = 300) -> Any:
    """Wait for a scenario's end; what ``get()`` returned (or raised), or ``None`` when it does not."""
    from demoapp.noharm import runs

    result = scenario.sent
    assert result is not None
    if not scenario.get:
        ids = ids_of(result)
        if scenario.runs:
            wait_for(lambda: sum(len(runs(i)) for i in ids) >= scenario.runs, timeout, scenario.name)
        else:
            wait_for(lambda: _states(ids)[0] in READY, timeout, f"{scenario.name} to be ready")
        return None
    try:
        return result.get(timeout=timeout, disable_sync_subtasks=False)  # type: ignore[call-arg]
    except Exception as exc:  # what the caller sees is compared, whatever it is
        return type(exc).__name__


def _states(ids: list[str]) -> list[str]:
    found = dict(TaskResult.objects.filter(task_id__in=ids).values_list("task_id", "status"))
    return [found.get(i, "-") for i in ids]


def observe(scenario: Scenario, got: Any) -> dict[str, Any]:
    from demoapp.noharm import runs

    ids = ids_of(scenario.sent)
    executions = Counter(f"{r['name']}{'/' + r['note'] if r['note'] else ''}" for i in ids for r in runs(i))
    return {
        "get": got,
        "states": _states(ids),
        "state of the caller's id": AsyncResult(ids[0]).state,
        "executions": dict(sorted(executions.items())),
        "audited": OrphanEvent.objects.filter(task_id__in=ids).count(),
    }


def looked_at(scenario: Scenario, sweeps: list[tuple[float, float]]) -> int:
    """How many sweeps began and ended within every execution of the scenario that ran for ``S``."""
    from demoapp.noharm import runs

    spans = [(r["began"], r["ended"]) for i in ids_of(scenario.sent) for r in runs(i)]
    spans = [(b, e) for b, e in spans if e - b >= S - 0.05]
    if not spans:
        return -1
    return min(sum(1 for sb, se in sweeps if b <= sb and se <= e) for b, e in spans)


def run_all(applicable: list[Scenario], quiet: Callable[[], None]) -> dict[str, dict[str, Any]]:
    """Send every scenario at once, wait for each to settle, let ``quiet`` pass, then observe each."""
    with warnings.catch_warnings():
        # A chord's on_error warns of a change Celery may make; the scenario uses today's behaviour.
        warnings.simplefilter("ignore", CPendingDeprecationWarning)
        for scenario in applicable:
            scenario.sent = scenario.send()
    for scenario in applicable:
        if scenario.after is not None:
            scenario.after(scenario.sent)  # type: ignore[arg-type]
    began = time.monotonic()
    got = {}
    for s in applicable:
        got[s.name] = settle(s)
        print(f"{s.name}: settled at {time.monotonic() - began:.1f} s")
    quiet()
    time.sleep(0.2)
    return {s.name: observe(s, got[s.name]) for s in applicable}
