"""Property tests: the sweep over thousands of malformed result rows and ledger entries.

Rows and entries are written straight into PostgreSQL and Redis, as a buggy worker, a hand-edited table,
a truncated write or a forger could leave them. Whatever they hold, the sweep finishes, publishes only
``@recoverable`` tasks (read back from the broker queue), and reports every row it can see exactly once
with the reason that fits it.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import pytest
from celery import current_app
from django.utils import timezone
from django_celery_results.models import TaskResult
from hypothesis import HealthCheck, Phase, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from celery_orphans import registry, sweep
from celery_orphans.decision import Action, Reason
from celery_orphans.entry import Delivery, Entry
from celery_orphans.models import OrphanEvent, Trigger
from celery_orphans.store import Keys, client
from tests import factories
from tests.helpers import published

pytestmark = pytest.mark.django_db(transaction=True)

RECOVERABLE = ("demoapp.summarize", "demoapp.add", "demoapp.echo", "demoapp.collect")
# Registered in the test project's app, but not marked @recoverable.
NOT_RECOVERABLE = (
    "demoapp.scan",
    "celery_orphans.reconcile",
    "celery.backend_cleanup",
    "celery.chord_unlock",
)
UNSAFE_CONTENT_TYPES = (
    "application/x-python-serialize",  # pickle
    "application/x-yaml",
    "application/data",
    "text/plain",
    "application/octet-stream",
    "",
    "application/json; charset=binary",
    "APPLICATION/JSON",
)
ROW_RESULT_CONTENT_TYPES = ("application/json", "application/x-python-serialize", "text/html", "")

# PostgreSQL text cannot hold NUL; everything else goes.
_CHARS = st.characters(exclude_categories=("Cs",), exclude_characters="\x00")
text = st.text(_CHARS, max_size=40)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=4),
    max_leaves=12,
)


@dataclass
class Spec:
    """One generated task: what is written for it, and what the sweep must make of it."""

    kind: str
    task_id: str
    name: str | None
    worker: str | None
    started: datetime | None  # the row's date_started; None leaves it NULL
    created: datetime  # the row's date_created
    row: bool = True
    result: str | None = None
    args: str | None = None
    kwargs: str | None = None
    row_content_type: str = "application/json"
    entry_raw: bytes | None = None  # the ledger entry exactly as stored
    entry_score: float = 0.0
    expected: tuple[Action, Reason] | None = None  # None: the sweep must not see it at all

    @property
    def sent_again(self) -> bool:
        return self.expected == (Action.RECOVER, Reason.RECOVERABLE)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        # How Hypothesis shows an example: what was drawn, in short. Every field in full makes a batch of
        # 60 run to tens of kilobytes, which Hypothesis warns of (and warnings are errors here).
        expected = "unseen" if self.expected is None else "/".join(str(e.value) for e in self.expected)
        printer.text(f"Spec({self.kind}, {self.task_id[:40]!r}, row={self.row}, expected={expected})")


def unknown_names() -> st.SearchStrategy[str]:
    return st.text(_CHARS, min_size=1, max_size=255).filter(lambda n: n not in current_app.tasks)


worker_names = st.one_of(
    st.text(_CHARS, min_size=1, max_size=100),
    st.just("w" * 100),
    st.builds(lambda n: f"{n}@fuzz", st.integers(0, 10**6)),
)
garbage_args = st.one_of(
    st.none(),
    st.text(_CHARS, max_size=1100).map(lambda s: s[:1024]),  # Celery truncates argsrepr at 1,024
    st.builds(lambda v: json.dumps(repr(v))[: 1024 // 2], json_values),
)
row_results = st.one_of(
    st.none(),
    text,
    st.builds(lambda pid, host: json.dumps({"pid": pid, "hostname": host}), st.integers(), text),
    json_values.map(json.dumps),
)


@st.composite
def times(draw: st.DrawFn, now: datetime) -> tuple[datetime | None, datetime]:
    """A past start, sometimes NULL with only the creation date to go by."""
    ago = timedelta(seconds=draw(st.floats(30, 3000)))
    if draw(st.booleans()):
        return None, now - ago
    return now - ago, now - ago - timedelta(seconds=draw(st.floats(0, 5)))


def entry_json(spec: Spec, made: Delivery, /, **changes: Any) -> bytes:
    started = spec.started or spec.created
    entry = Entry(
        task_id=spec.task_id,
        task_name=spec.name or "",
        node=spec.worker or "",
        boot="dead-boot",
        recorded_at=started.timestamp(),
        delivery=made,
    )
    data = json.loads(entry.to_json())
    data.update(changes)
    return factories.sealed(json.dumps(data)).encode()


@st.composite
def deliveries(draw: st.DrawFn, name: str, task_id: str, content_type: str = "application/json") -> Delivery:
    """A message built the way Celery builds it, with generated (garbage, but JSON) arguments."""
    args = tuple(draw(st.lists(json_values, max_size=3)))
    kwargs = draw(
        st.dictionaries(
            st.text(st.characters(categories=("Ll",)), min_size=1, max_size=8), json_values, max_size=3
        )
    )
    made = factories.delivery(name, task_id, args, kwargs)
    return dataclasses.replace(made, content_type=content_type)


@st.composite
def malformed_entries(draw: st.DrawFn, spec: Spec) -> bytes:
    made = factories.delivery(spec.name or "demoapp.summarize", spec.task_id)
    good = entry_json(spec, made)
    return draw(
        st.one_of(
            st.builds(lambda cut: good[:cut], st.integers(0, len(good) - 1)),  # a truncated write
            st.binary(max_size=200),
            json_values.map(lambda v: json.dumps(v).encode()),
            st.just(entry_json(spec, made, version=2)),
            st.just(entry_json(spec, made, surprise=True)),
            st.builds(
                lambda d: entry_json(spec, made, delivery=d),
                json_values.filter(lambda v: not isinstance(v, dict)),
            ),
        )
    )


KINDS = (
    "recoverable",
    "recoverable_entry_only",
    "unknown_name",
    "no_name",
    "not_recoverable",
    "forged_entry_not_recoverable",
    "no_worker",
    "no_entry",
    "unsafe_content_type",
    "malformed_entry",
    "malformed_entry_only",
    "name_mismatch",
    "entry_of_another_id",
    "too_old",
    "started_in_the_future",
)


@st.composite
def specs(draw: st.DrawFn, now: datetime) -> Spec:
    kind = draw(st.sampled_from(KINDS))
    started, created = draw(times(now))
    spec = Spec(
        kind=kind,
        task_id=str(uuid.uuid4()),
        name=draw(st.sampled_from(RECOVERABLE)),
        worker=draw(worker_names),
        started=started,
        created=created,
        result=draw(row_results),
        args=draw(garbage_args),
        kwargs=draw(garbage_args),
        row_content_type=draw(st.sampled_from(ROW_RESULT_CONTENT_TYPES)),
    )
    recover = (Action.RECOVER, Reason.RECOVERABLE)
    if kind == "recoverable":
        spec.entry_raw, spec.expected = entry_json(spec, draw(deliveries(spec.name, spec.task_id))), recover
    elif kind == "recoverable_entry_only":
        spec.row = False
        spec.entry_raw, spec.expected = entry_json(spec, draw(deliveries(spec.name, spec.task_id))), recover
    elif kind == "unknown_name":
        spec.name = draw(unknown_names())
        spec.row = draw(st.booleans())
        if not spec.row or draw(st.booleans()):
            spec.entry_raw = entry_json(spec, factories.delivery(spec.name, spec.task_id))
        spec.expected = (Action.REPORT, Reason.UNKNOWN_TASK)
    elif kind == "no_name":
        spec.name, spec.expected = None, (Action.REPORT, Reason.UNKNOWN_TASK)
    elif kind == "not_recoverable":
        spec.name = draw(st.sampled_from(NOT_RECOVERABLE))
        spec.expected = (Action.MARK_TERMINAL, Reason.NOT_RECOVERABLE)
    elif kind == "forged_entry_not_recoverable":
        # A ledger entry for a task that must never run twice, written by someone other than our worker.
        spec.name = draw(st.sampled_from(NOT_RECOVERABLE))
        spec.row = draw(st.booleans())
        spec.entry_raw = entry_json(spec, draw(deliveries(spec.name, spec.task_id)))
        spec.expected = (Action.MARK_TERMINAL, Reason.NOT_RECOVERABLE)
    elif kind == "no_worker":
        spec.worker = draw(st.sampled_from([None, ""]))
        spec.result = draw(st.sampled_from([None, "", "null", '{"pid": 3}', '{"hostname": ""}', "[1, 2]"]))
        spec.expected = (Action.REPORT, Reason.NO_WORKER)
    elif kind == "no_entry":
        spec.expected = (Action.MARK_TERMINAL, Reason.NO_LEDGER_ENTRY)
    elif kind == "unsafe_content_type":
        content_type = draw(st.sampled_from(UNSAFE_CONTENT_TYPES))
        spec.entry_raw = entry_json(spec, draw(deliveries(spec.name, spec.task_id, content_type)))
        spec.expected = (Action.MARK_TERMINAL, Reason.UNSAFE_MESSAGE)
    elif kind in {"malformed_entry", "malformed_entry_only"}:
        spec.row = kind == "malformed_entry"
        spec.entry_raw = draw(malformed_entries(spec))
        spec.expected = (Action.REPORT, Reason.UNREADABLE)
    elif kind == "name_mismatch":
        # The row says one task, the entry another: neither is trusted.
        spec.entry_raw = entry_json(
            spec, factories.delivery("demoapp.add", spec.task_id), task_name="demoapp.add"
        )
        spec.name = draw(st.sampled_from(NOT_RECOVERABLE))
        spec.expected = (Action.REPORT, Reason.UNREADABLE)
    elif kind == "entry_of_another_id":
        other = str(uuid.uuid4())
        spec.entry_raw = entry_json(spec, factories.delivery(spec.name, other), task_id=other)
        spec.expected = (Action.REPORT, Reason.UNREADABLE)
    elif kind == "too_old":
        spec.started = spec.created = now - timedelta(days=draw(st.floats(1.01, 400)))
        spec.entry_raw = entry_json(spec, draw(deliveries(spec.name, spec.task_id)))
        spec.expected = (Action.MARK_TERMINAL, Reason.TOO_OLD)
    elif kind == "started_in_the_future":
        # A clock that jumped, or a forged start: reported, never judged by an age it cannot have. (With a
        # ledger entry whose boot is known gone, Redis's clock tells the end whatever the start says:
        # test_never_twice_under_faults steps a killed worker's clock ahead for that.) A day ahead at
        # least, so that the start is still ahead when a slow run sweeps.
        spec.started = spec.created = now + timedelta(seconds=draw(st.floats(86_400, 10**8)))
        spec.expected = (Action.REPORT, Reason.UNREADABLE)
    spec.entry_score = (spec.started or spec.created).timestamp()
    return spec


def write(batch: list[Spec]) -> None:
    """Store every row and entry as given, bypassing the code that normally writes them."""
    rows = [
        TaskResult(
            task_id=s.task_id,
            task_name=s.name,
            status="STARTED",
            worker=s.worker,
            date_started=s.started,
            result=s.result,
            task_args=s.args,
            task_kwargs=s.kwargs,
            content_type=s.row_content_type,
            content_encoding="utf-8",
        )
        for s in batch
        if s.row
    ]
    TaskResult.objects.bulk_create(rows)
    for s in batch:  # auto_now_add overrode the creation date
        if s.row:
            TaskResult.objects.filter(task_id=s.task_id).update(date_created=s.created)
    keys = Keys.current()
    pipe = client().pipeline(transaction=False)
    for s in batch:
        if s.entry_raw is not None:
            pipe.hset(keys.entry(s.task_id), mapping={"token": uuid.uuid4().hex, "entry": s.entry_raw})
            pipe.zadd(keys.inflight, {s.task_id: s.entry_score})
    pipe.execute()


def reset(redis_client: Any) -> None:
    redis_client.flushdb()
    TaskResult.objects.all().delete()
    OrphanEvent.objects.all().delete()


def check_batch(batch: list[Spec], redis_client: Any) -> None:
    reset(redis_client)
    write(batch)

    report = sweep.run(sweep.Options(trigger=Trigger.BEAT, grace_seconds=0))

    by_id = {s.task_id: s for s in batch}
    seen = Counter(o.decision.task_id for o in report.outcomes)
    assert set(seen) == {s.task_id for s in batch if s.expected is not None}
    assert set(seen.values()) <= {1}, "a task was reported more than once"
    for o in report.outcomes:
        spec = by_id[o.decision.task_id]
        assert (o.decision.action, o.decision.reason) == spec.expected, (spec.kind, o)
        assert o.error is None
        assert o.done == (o.decision.action is not Action.REPORT), (spec.kind, o)
        if o.decision.action is Action.REPORT:
            assert o.decision.detail, f"{spec.kind}: reported without saying why"

    recoverable = set(registry.recoverable_tasks(current_app))
    sent = published(redis_client)
    assert all(h["task"] in recoverable for h in sent), [h["task"] for h in sent]
    assert sorted(h["id"] for h in sent) == sorted(s.task_id for s in batch if s.sent_again)
    audited = Counter(OrphanEvent.objects.exclude(action="reported").values_list("task_id", flat=True))
    assert audited == Counter(o.decision.task_id for o in report.outcomes if o.done)
    # A record that cannot be trusted is audited as reported, once, and nothing is done with it.
    reported = Counter(OrphanEvent.objects.filter(action="reported").values_list("task_id", flat=True))
    unreadable = [o for o in report.outcomes if o.decision.reason is Reason.UNREADABLE]
    assert reported == Counter(o.decision.task_id for o in unreadable)

    # What was not acted on stays as it was; the next sweep finds it again and sends nothing more.
    untouched = {s.task_id for s in batch if s.row and (s.expected is None or s.expected[0] is Action.REPORT)}
    still_started = TaskResult.objects.filter(task_id__in=untouched, status="STARTED")
    assert set(still_started.values_list("task_id", flat=True)) == untouched
    again = sweep.run(sweep.Options(trigger=Trigger.BEAT, grace_seconds=0))
    assert {o.decision.task_id for o in again.outcomes if o.done} == set()
    assert len(published(redis_client)) == len(sent)


@pytest.fixture
def quick_sweeps(settings: Any) -> None:
    # Every node here is a ghost: none answers, so every sweep waits the whole inspect timeout.
    settings.CELERY_ORPHANS_INSPECT_TIMEOUT_SECONDS = 0.05
    settings.CELERY_ORPHANS_MAX_RECOVERIES_PER_SWEEP = None


def test_sweep_survives_malformed_rows_and_entries_and_reports_each_once(redis_client, quick_sweeps):
    now = timezone.now()
    written: list[int] = []

    @hsettings(
        max_examples=25,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(batch=st.lists(specs(now), min_size=40, max_size=60))
    def check(batch: list[Spec]) -> None:
        check_batch(batch, redis_client)
        written.append(len(batch))

    check()

    assert sum(written) >= 1000


# Found by the property test below; each once crashed the sweep outright (an uncaught TypeError or
# AttributeError), so one such entry stopped every sweep until someone deleted it by hand.
MISTYPED = [
    pytest.param(("delivery", "headers"), "not a mapping", id="headers-not-an-object"),
    pytest.param(("delivery", "content_type"), ["application/json"], id="content-type-a-list"),
    pytest.param(("delivery", "body"), None, id="body-null"),
    pytest.param(("delivery", "properties"), None, id="properties-null"),
    pytest.param(("recorded_at",), None, id="recorded-at-null"),
    pytest.param(("node",), ["w1@test"], id="node-a-list"),
    pytest.param(("task_name",), ["demoapp.summarize"], id="task-name-a-list"),
    pytest.param(("delivery", "routing_key"), "", id="no-queue-named"),
    pytest.param(("delivery", "content_encoding"), "no-such-codec", id="unknown-content-encoding"),
    pytest.param(("delivery", "properties"), {"exchange": "x"}, id="property-clashing-with-an-argument"),
]


@pytest.mark.parametrize(("path", "value"), MISTYPED)
def test_ledger_entry_with_a_field_of_the_wrong_type_is_reported_unreadable(
    path: tuple[str, ...], value: object, redis_client: Any, quick_sweeps: None
) -> None:
    task_id = factories.orphan()
    fine = factories.orphan()
    keys = Keys.current()
    data = factories.opened(redis_client.hget(keys.entry(task_id), "entry"))
    *parents, last = path
    target = data
    for key in parents:
        target = target[key]
    target[last] = value
    redis_client.hset(keys.entry(task_id), "entry", factories.sealed(json.dumps(data)))

    report = sweep.run(sweep.Options(trigger=Trigger.BEAT, grace_seconds=0))

    found = {o.decision.task_id: o for o in report.outcomes}
    assert found[task_id].decision.action is Action.REPORT
    assert found[task_id].decision.reason is Reason.UNREADABLE
    assert "unreadable ledger entry" in found[task_id].decision.detail
    assert found[fine].done
    assert [h["id"] for h in published(redis_client)] == [fine]


ENTRY_FIELDS = ("task_id", "task_name", "node", "boot", "recorded_at")
DELIVERY_FIELDS = tuple(f.name for f in dataclasses.fields(Delivery))


@st.composite
def mistyped_entries(draw: st.DrawFn, now: datetime) -> Spec:
    """Entries that parse as JSON of the right version and shape, with a field of the wrong type or value."""
    spec = draw(specs(now).filter(lambda s: s.kind == "recoverable"))
    data = factories.opened(spec.entry_raw or b"")
    if draw(st.booleans()):
        data[draw(st.sampled_from(ENTRY_FIELDS))] = draw(json_values)
    else:
        data["delivery"][draw(st.sampled_from(DELIVERY_FIELDS))] = draw(json_values)
    spec.entry_raw = factories.sealed(json.dumps(data)).encode()
    spec.kind, spec.expected = "mistyped_entry", None
    return spec


def test_sweep_survives_ledger_entries_with_fields_of_the_wrong_type(redis_client, quick_sweeps):
    now = timezone.now()

    @hsettings(
        max_examples=200,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        # Stop at the first crash: the parametrized test above names each one.
        phases=[Phase.generate],
        report_multiple_bugs=False,
    )
    @given(spec=mistyped_entries(now))
    def check(spec: Spec) -> None:
        reset(redis_client)
        write([spec])
        report = sweep.run(sweep.Options(trigger=Trigger.BEAT, grace_seconds=0))
        [outcome] = report.outcomes
        judged = (outcome.decision.action, outcome.decision.reason)
        # Acted on cleanly, reported unreadable, or (a start time moved into the future) left in grace.
        assert (outcome.done and outcome.error is None) or judged in {
            (Action.REPORT, Reason.UNREADABLE),
            (Action.LEAVE, Reason.IN_GRACE),
        }
        recoverable = set(registry.recoverable_tasks(current_app))
        assert all(h["task"] in recoverable and h["id"] == spec.task_id for h in published(redis_client))

    check()


def test_a_task_started_in_the_future_is_reported_not_skipped(redis_client, quick_sweeps):
    task_id = factories.orphan(started_ago=-86_400)

    report = sweep.run(sweep.Options(trigger=Trigger.BEAT, grace_seconds=0))

    [outcome] = report.outcomes
    assert outcome.decision.task_id == task_id
    assert (outcome.decision.action, outcome.decision.reason) == (Action.REPORT, Reason.UNREADABLE)
    assert "in the future" in outcome.decision.detail
    assert not published(redis_client)
    assert TaskResult.objects.get(task_id=task_id).status == "STARTED"  # left for a person


def test_a_start_a_few_seconds_ahead_is_only_in_grace(redis_client, quick_sweeps):
    # Hosts' clocks differ a little: a task that has just started on a host ahead of ours is not suspect.
    task_id = factories.orphan(started_ago=-2)

    report = sweep.run(sweep.Options(trigger=Trigger.BEAT, grace_seconds=0))

    [outcome] = report.outcomes
    assert (outcome.decision.task_id, outcome.decision.action) == (task_id, Action.LEAVE)
    assert outcome.decision.reason is Reason.IN_GRACE
