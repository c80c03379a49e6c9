"""The README's demo, run as a new user runs it: ``bash testproject/demo.sh`` on a machine where
PostgreSQL and RabbitMQ are not there to start."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT

ABSENT = ("pg_isready", "pg_ctlcluster", "rabbitmq-server", "rabbitmqctl")


def installed_as() -> dict[str, str]:
    """EXTRAS, VERSIONS and FRESH_TOOLS as this virtualenv was made, so setup-env.sh reuses it."""
    stamp = (Path(sys.prefix) / ".celery-orphans-installed").read_text()
    env = {"VENV": sys.prefix}
    if stamp.endswith(" fresh tools"):
        stamp, env["FRESH_TOOLS"] = stamp.removesuffix(" fresh tools"), "1"
    extras, _, versions = stamp.partition(" ")
    return {**env, "EXTRAS": extras or "test", "VERSIONS": versions}


@pytest.mark.worker
def test_the_demo_recovers_a_killed_workers_tasks_without_postgresql_or_rabbitmq(tmp_path: Path) -> None:
    called = tmp_path / "called"
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    for name in ABSENT:
        tool = fake_bin / name
        tool.write_text(f'#!/bin/sh\necho {name} >> "{called}"\nexit 1\n')
        tool.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DEMO_", "TEST_", "CELERY_"))}
    env |= installed_as() | {"PATH": f"{fake_bin}{os.pathsep}{env['PATH']}"}

    demo = subprocess.run(
        ["bash", str(ROOT / "testproject" / "demo.sh")], env=env, capture_output=True, text=True, timeout=240
    )

    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert not called.exists(), called.read_text()
    assert "postgresql" not in demo.stderr and "rabbitmq" not in demo.stderr, demo.stderr
    assert re.search(r"demoapp\.summarize\s+recovered\s+reason: recoverable", demo.stdout), demo.stdout
    assert re.search(r"demoapp\.scan\s+marked_terminal", demo.stdout), demo.stdout
    assert re.search(r"all three handled \d+\.\d\ds after the kill", demo.stdout), demo.stdout
    assert "executions of summarize: 2 started, 1 finished" in demo.stdout, demo.stdout
