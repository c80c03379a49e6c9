"""The CI size of ``benchmarks/chaos.py``: workers SIGKILLed at random under a stream of recoverable tasks.

120 tasks of 0.5 to 3 s on three ``prefork -c 2`` workers, one worker killed every ~3 s and restarted at
once, half the time under its own name; the regular sweep runs every second. Every task must end
SUCCESS, finished by exactly one execution, and every extra start must be an execution that a kill cut
short. Once with Redis as the broker, once with RabbitMQ (the ledger and leases stay in Redis).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.worker


def chaos_run(env: dict[str, str], tmp_path: Path) -> Any:
    from benchmarks import chaos

    env = {**env, "CELERY_ORPHANS_ENABLED": "true", "TESTPROJECT_VISIBILITY_TIMEOUT": "30"}
    result = chaos.run(
        tasks=120, kill_every=3, workdir=tmp_path, env=env, sweep_every=1, seed=7, timeout=300, say=print
    )
    print("\n".join(result.lines()))
    return result


def assert_every_task_ran_to_completion_exactly_once(result: Any) -> None:
    assert result.kills >= 5
    assert result.success == result.tasks
    assert result.finished_per_task == {1: result.tasks}
    assert result.unexplained_extra_starts == 0
    assert result.stale_copy_executions == 0
    assert result.overlapping_effects == 0
    assert result.left_unfinished == 0
    assert result.marked_terminal == 0


def test_chaos_on_redis_every_task_finishes_exactly_once(
    workers: Any, redis_client: Any, tmp_path: Path
) -> None:
    result = chaos_run(workers.env, tmp_path)

    assert_every_task_ran_to_completion_exactly_once(result)


def test_chaos_on_rabbitmq_every_task_finishes_exactly_once(
    workers: Any, redis_client: Any, tmp_path: Path, amqp_broker: str
) -> None:
    result = chaos_run({**workers.env, "CELERY_BROKER_URL": amqp_broker}, tmp_path)

    assert_every_task_ran_to_completion_exactly_once(result)
