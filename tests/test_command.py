"""``manage.py reconcile_orphan_tasks`` against real orphans: a worker SIGKILLed mid-task."""

from __future__ import annotations

import io
import json
import subprocess
import time
from dataclasses import dataclass

import pytest
from django.core.management import CommandError, call_command
from django_celery_results.models import TaskResult

from celery_orphans import leases
from celery_orphans.models import OrphanEvent
from tests import helpers
from tests.helpers import wait_for
from tests.test_locks import held_in_thread

NODE = "cmd@test"
QUEUES = ("celery",)


@dataclass(frozen=True)
class Orphans:
    summarize: str  # @recoverable: sent again
    scan: str  # not recoverable: marked terminal


@pytest.fixture
def orphans(workers) -> Orphans:
    """One recoverable and one non-recoverable task, both running on a worker that was then SIGKILLed.

    Each is killed once its body has begun (it recorded its start), not merely once its row says STARTED:
    the tests count the runs of each body."""
    from demoapp.tasks import runs, scan, summarize

    worker = workers.start(NODE, concurrency=2)
    ids = Orphans(summarize.delay([1, 2, 3], seconds=60).id, scan.delay("db-1", seconds=60).id)
    for task_id in (ids.summarize, ids.scan):
        wait_for(
            lambda t=task_id: TaskResult.objects.filter(task_id=t, status="STARTED", worker=NODE).exists(),
            20,
            f"{task_id} STARTED on {NODE}",
        )
        wait_for(
            lambda t=task_id: any(e.startswith("start") for e in runs(t)), 20, f"{task_id}'s body to begin"
        )
    worker.kill()
    wait_for(lambda: not leases.fresh_boots([NODE])[NODE], 10, f"the lease of {NODE} to lapse")
    return ids


def command(*args: str) -> tuple[str, str]:
    out, err = io.StringIO(), io.StringIO()
    call_command("reconcile_orphan_tasks", *args, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


def manage(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run the command as a script would: its own process, its exit code, its stdout and stderr."""
    return helpers.manage("reconcile_orphan_tasks", *args, env=env)


# The one JSON shape of a task's result, shared with the HTTP API (docs/api.md).
OUTCOME_FIELDS = {
    "task_id", "task_name", "worker", "action", "reason", "evidence", "detail", "attempt", "done", "error",
    "status", "message",
}  # fmt: skip


def json_lines(out: str) -> dict[str, dict[str, object]]:
    """Every line parsed as one JSON object, by task id."""
    objects = [json.loads(line) for line in out.splitlines()]
    assert all(isinstance(o, dict) for o in objects)
    by_id = {str(o["task_id"]): o for o in objects}
    assert len(by_id) == len(objects)
    return by_id


# kombu (5.7+) keeps a deadline per exchange binding table. Asking workers (the one query_task broadcast)
# binds a reply queue, and kombu notes that table's deadline under the "reply." exchange of the asker;
# the queue itself is gone once the reply is in. That note is the broker's plumbing, not task state.
BINDING_DEADLINES = b"_kombu.binding_deadlines"


def redis_value(redis_client, key: bytes) -> tuple[bytes, object]:
    kind = redis_client.type(key)
    if key == BINDING_DEADLINES:
        return kind, [
            (m, s) for m, s in redis_client.zrange(key, 0, -1, withscores=True) if not m.startswith(b"reply.")
        ]
    if kind == b"hash":
        # DUMP writes a large hash's fields in its table's order, which a read may change (Redis moves a
        # growing table a step at each access): the fields and values are what the command could change.
        return kind, redis_client.hgetall(key)
    return kind, redis_client.dump(key)


def state(redis_client) -> dict[str, object]:
    """Everything the command could change: result rows, audit rows, every Redis key, queue lengths."""
    keys = sorted(redis_client.scan_iter(count=1000))
    return {
        "rows": list(TaskResult.objects.order_by("task_id").values()),
        "events": list(OrphanEvent.objects.values()),
        "redis": {key: redis_value(redis_client, key) for key in keys},
        "queues": {queue: redis_client.llen(queue) for queue in QUEUES},
        # When each key expires on its own (a killed worker's machine record outlives its lease by two
        # leases): a key gone by then was not removed by the command.
        "expires_at": {
            key: time.monotonic() + ttl / 1000 for key, ttl in expiries(redis_client).items() if ttl >= 0
        },
    }


def expiries(redis_client) -> dict[bytes, int]:
    return {key: redis_client.pttl(key) for key in redis_client.scan_iter(count=1000)}


def assert_untouched(before: dict[str, object], after: dict[str, object]) -> None:
    assert after["rows"] == before["rows"]
    assert after["events"] == before["events"] == []
    assert after["queues"] == before["queues"]
    expired = {
        k for k, at in before["expires_at"].items() if k not in after["redis"] and at <= time.monotonic()
    }
    changed = sorted(
        k
        for k in before["redis"].keys() | after["redis"].keys()
        if before["redis"].get(k) != after["redis"].get(k) and k not in expired
    )
    assert changed == [], changed


# --- dry run -------------------------------------------------------------------------------------


@pytest.mark.worker
def test_dry_run_decides_and_reports_but_changes_nothing(orphans, redis_client, settings):
    settings.CELERY_ORPHANS_ENABLED = True
    before, ttl_before = state(redis_client), expiries(redis_client)
    assert before["queues"] == {"celery": 0}
    assert before["redis"], "the orphans left nothing in Redis to compare"

    out, _ = command("--dry-run", "--grace-minutes", "0", "--json")

    decided = json_lines(out)
    assert decided[orphans.summarize]["action"] == "recover"
    assert decided[orphans.scan]["action"] == "mark_terminal"
    assert_untouched(before, state(redis_client))
    # No expiry was pushed back either (a refreshed key would live longer than it did before).
    ttl_after = expiries(redis_client)
    assert all(ttl_after.get(key, -2) <= ttl for key, ttl in ttl_before.items() if ttl > 0)  # -2: expired
    persistent = {key for key, ttl in ttl_before.items() if ttl == -1}
    assert {key for key, ttl in ttl_after.items() if ttl == -1} == persistent


@pytest.mark.worker
def test_dry_run_works_with_recovery_switched_off(orphans, redis_client, settings):
    settings.CELERY_ORPHANS_ENABLED = False
    before = state(redis_client)

    out, _ = command("--dry-run", "--grace-minutes", "0")

    assert orphans.summarize in out
    assert orphans.scan in out
    assert "Dry run: would have recovered 1 orphaned tasks, would have marked 1 terminal" in out
    assert_untouched(before, state(redis_client))


@pytest.mark.worker
def test_real_run_with_recovery_switched_off_is_refused_and_changes_nothing(orphans, redis_client, settings):
    settings.CELERY_ORPHANS_ENABLED = False
    before = state(redis_client)

    with pytest.raises(CommandError, match="CELERY_ORPHANS_ENABLED is off"):
        command("--grace-minutes", "0")
    script = manage("--grace-minutes", "0", env={"CELERY_ORPHANS_ENABLED": "false"})

    assert script.returncode == 1
    assert "CELERY_ORPHANS_ENABLED is off" in script.stderr
    assert "--dry-run" in script.stderr
    after = state(redis_client)
    # Nothing changed but the audit log's record of the two refusals.
    refusals = after.pop("events")
    assert [(e["action"], e["reason"], e["trigger"]) for e in refusals] == [
        ("refused", "switched_off", "command")
    ] * 2
    assert_untouched(before, {**after, "events": []})


# --- output --------------------------------------------------------------------------------------


@pytest.mark.worker
def test_json_prints_one_object_per_orphan_with_its_decision_and_reason(orphans, redis_client):
    script = manage("--dry-run", "--grace-minutes", "0", "--json")

    assert script.returncode == 0, script.stderr
    decided = json_lines(script.stdout)
    assert set(decided) == {orphans.summarize, orphans.scan}
    for task in decided.values():
        assert set(task) == OUTCOME_FIELDS
    assert {k: decided[orphans.summarize][k] for k in ("task_name", "worker", "action", "reason")} == {
        "task_name": "demoapp.summarize",
        "worker": NODE,
        "action": "recover",
        "reason": "recoverable",
    }
    assert {k: decided[orphans.scan][k] for k in ("task_name", "worker", "action", "reason")} == {
        "task_name": "demoapp.scan",
        "worker": NODE,
        "action": "mark_terminal",
        "reason": "not_recoverable",
    }


@pytest.mark.worker
def test_table_lists_each_orphan_and_ends_with_a_summary(orphans, redis_client):
    out, _ = command("--dry-run", "--grace-minutes", "0")

    lines = out.splitlines()
    assert lines[0].split() == ["TASK", "ID", "TASK", "NAME", "WORKER", "ACTION", "REASON", "EVIDENCE"]
    rows = {line.split()[0]: line.split()[1:] for line in lines[1:-1]}
    assert rows[orphans.summarize][:4] == ["demoapp.summarize", NODE, "recover", "recoverable"]
    assert rows[orphans.scan][:4] == ["demoapp.scan", NODE, "mark_terminal", "not_recoverable"]
    assert lines[-1].startswith(
        "Dry run: would have recovered 1 orphaned tasks, would have marked 1 terminal, "
        "would have forgotten 0 finished, 0 alive or in grace, 0 unreadable ("
    )


# --- arguments -----------------------------------------------------------------------------------


@pytest.mark.worker
def test_fractional_grace_minutes_leave_a_task_that_just_started_alone(orphans, redis_client):
    out, _ = command("--dry-run", "--grace-minutes", "0.5")

    assert orphans.summarize not in out
    assert orphans.scan not in out
    assert out.startswith("Dry run: would have recovered 0 orphaned tasks, would have marked 0 terminal")


@pytest.mark.worker
def test_all_lists_a_task_in_grace_as_left_alone(orphans, redis_client):
    out, _ = command("--dry-run", "--grace-minutes", "0.5", "--json", "--all")

    decided = json_lines(out)
    assert set(decided) == {orphans.summarize, orphans.scan}
    assert {(t["action"], t["reason"]) for t in decided.values()} == {("leave", "in_grace")}


@pytest.mark.worker
def test_grace_minutes_spare_a_young_task_even_when_its_worker_is_known_dead(workers, redis_client, settings):
    from demoapp.tasks import summarize

    worker = workers.start(NODE)
    task_id = summarize.delay([1, 2, 3], seconds=60).id
    wait_for(lambda: TaskResult.objects.filter(task_id=task_id, status="STARTED").exists(), 20, "STARTED")
    worker.kill()
    wait_for(lambda: not leases.fresh_boots([NODE], prune=False)[NODE], 10, f"the lease of {NODE} to lapse")
    settings.CELERY_ORPHANS_GRACE_SECONDS = 300

    asked = json_lines(command("--dry-run", "--grace-minutes", "5", "--json", "--all")[0])[task_id]
    default = json_lines(command("--dry-run", "--json", "--all")[0])[task_id]

    assert (asked["action"], asked["reason"]) == ("leave", "in_grace")
    assert (default["action"], default["evidence"]) == ("recover", "lease_lapsed")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--grace-minutes", "-1"], "grace must be between 0 and"),
        (["--grace-minutes=-0.5"], "grace must be between 0 and"),
        (["--grace-minutes", "abc"], "'abc' is not a number of minutes"),
        (["--grace-minutes", "nan"], "grace must be between 0 and"),
        (["--max-attempts", "0"], "must be at least 1"),
        (["--max-attempts", "-3"], "must be at least 1"),
        (["--max-attempts", "1.5"], "is not a whole number"),
    ],
)
def test_bad_arguments_are_refused_before_anything_runs(args, message):
    with pytest.raises(CommandError, match=message):
        command("--dry-run", *args)


@pytest.mark.django_db(transaction=True)
def test_bad_argument_exits_with_a_usage_error():
    script = manage("--grace-minutes", "-1")

    assert script.returncode == 2
    assert "grace must be between 0 and" in script.stderr
    assert "usage:" in script.stderr


@pytest.mark.parametrize("grace", ["inf", "1e12"])
def test_grace_too_large_for_a_date_is_refused(grace):
    with pytest.raises(CommandError, match="grace"):
        command("--dry-run", "--grace-minutes", grace)


# --- real runs -----------------------------------------------------------------------------------


@pytest.mark.worker
def test_real_run_recovers_one_orphan_and_marks_the_other_terminal(orphans, workers, redis_client):
    from demoapp.tasks import runs

    script = manage("--grace-minutes", "0", env={"CELERY_ORPHANS_ENABLED": "true"})

    assert script.returncode == 0, script.stderr
    assert "recovered 1 orphaned tasks, marked 1 terminal" in script.stdout.splitlines()[-1]
    assert orphans.summarize in script.stdout
    assert orphans.scan in script.stdout
    events = {e.task_id: e for e in OrphanEvent.objects.all()}
    recovered, terminal = events[orphans.summarize], events[orphans.scan]
    assert (recovered.action, recovered.trigger, recovered.attempt) == ("recovered", "command", 1)
    assert (terminal.action, terminal.reason, terminal.trigger) == (
        "marked_terminal",
        "not_recoverable",
        "command",
    )
    assert TaskResult.objects.get(task_id=orphans.scan).status == "FAILURE"

    assert redis_client.llen("celery") == 1

    # The re-sent message runs again under the same id (it sleeps as long as before, so only its start
    # is awaited); the scan never runs again.
    workers.start("after@test")
    wait_for(lambda: sum(e.startswith("start") for e in runs(orphans.summarize)) == 2, 20, "the re-run")
    wait_for(
        lambda: TaskResult.objects.filter(task_id=orphans.summarize, status="STARTED", worker="after@test"),
        20,
        "the re-run's STARTED row",
    )
    assert sum(e.startswith("start") for e in runs(orphans.scan)) == 1


@pytest.mark.django_db(transaction=True)
def test_sweep_lock_held_elsewhere_makes_the_command_fail_and_say_so(redis_client):
    with held_in_thread():
        script = manage("--grace-minutes", "0", env={"CELERY_ORPHANS_ENABLED": "true"})

    assert script.returncode == 1
    assert "lock" in script.stderr
    assert "Traceback" not in script.stderr
    assert list(OrphanEvent.objects.values_list("action", "reason")) == [("refused", "locked")]


@pytest.mark.parametrize(
    "url", ["redis://127.0.0.1:1/0", "redis://:s3cret@127.0.0.1:1/0", "sentinel://:s3cret@127.0.0.1:1/0"]
)
@pytest.mark.parametrize("mode", [[], ["--dry-run"]], ids=["run", "dry-run"])
@pytest.mark.django_db(transaction=True)
def test_unreachable_redis_fails_with_a_clear_message_that_hides_the_password(url, mode):
    from django.conf import settings

    # The broker stays reachable.
    script = manage(
        *mode,
        "--grace-minutes",
        "0",
        env={
            "REDIS_URL": url,
            "CELERY_ORPHANS_REDIS_URL": url,
            "CELERY_ORPHANS_REDIS_SENTINEL_MASTER": "orphans",
            "CELERY_BROKER_URL": settings.CELERY_BROKER_URL,
            "CELERY_ORPHANS_ENABLED": "true",
        },
    )

    assert script.returncode == 1
    assert "cannot reach Redis" in script.stderr
    assert ("orphans" if url.startswith("sentinel") else "127.0.0.1:1") in script.stderr
    assert "Traceback" not in script.stderr
    assert "s3cret" not in script.stdout + script.stderr


@pytest.mark.parametrize("checks", [[], ["--skip-checks"]], ids=["checked", "unchecked"])
@pytest.mark.parametrize("url", ["http://:s3cret@127.0.0.1:6379/0", "s3cret", "redis://:s3cret@/0"])
def test_a_malformed_redis_url_fails_with_a_clear_message_that_hides_the_password(checks, url):
    script = manage(*checks, "--dry-run", env={"CELERY_ORPHANS_REDIS_URL": url})

    assert script.returncode == 1
    # Django runs the checks first (E006); without them the command says the same.
    assert (
        "celery_orphans.E006" if not checks else "CommandError: CELERY_ORPHANS_REDIS_URL"
    ) in script.stderr
    assert "Traceback" not in script.stderr
    assert "s3cret" not in script.stdout + script.stderr


@pytest.mark.parametrize("mode", [[], ["--dry-run"]], ids=["run", "dry-run"])
def test_unreachable_database_fails_with_a_clear_message_that_hides_the_password(mode):
    script = manage(
        *mode,
        "--grace-minutes",
        "0",
        env={
            "DATABASE_URL": "postgres://someone:pw-s3cret@127.0.0.1:1/nowhere",
            "CELERY_ORPHANS_ENABLED": "true",
        },
    )

    assert script.returncode == 1
    assert "CommandError: cannot reach the database (OperationalError; see the server's log)" in script.stderr
    assert "Traceback" not in script.stderr
    assert "pw-s3cret" not in script.stdout + script.stderr
