"""A stranger's install: the built wheel (and the sdist) in a fresh virtualenv with no extras, a new
project, Beat and a worker on Redis, the worker killed, the task recovered.

Nothing of this checkout is on the path of those processes: they run only what pip installed from the
package and what the project declares, so a dependency the package forgets to declare fails here.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import ROOT, wait_for
from tests.services import RedisServer

pytestmark = pytest.mark.worker

MINIMAL_PROJECT = Path(__file__).parent / "minimal_project"
# Where the package's source is: this checkout, or the one tests/installed.py copied the suite from.
SOURCE = Path(os.environ.get("TEST_CELERY_ORPHANS_CHECKOUT", ROOT))


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The sdist, and the wheel built from it, as ``python -m build`` makes them for a release."""
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(out), str(SOURCE)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    return {"wheel": next(out.glob("*.whl")), "sdist": next(out.glob("*.tar.gz"))}


class Project:
    """A copy of tests/minimal_project run by a virtualenv of its own, on SQLite and its own Redis."""

    def __init__(self, root: Path, venv: Path, redis_url: str, app: str = "proj") -> None:
        self.root, self.venv, self.app = root, venv, app
        self.database = root / "db.sqlite3"
        self.env = {
            "PATH": f"{venv / 'bin'}{os.pathsep}/usr/local/bin{os.pathsep}/usr/bin{os.pathsep}/bin",
            "HOME": str(root),
            "LANG": "C.UTF-8",
            "DJANGO_SETTINGS_MODULE": "proj.settings",
            "DATABASE_URL": f"sqlite:///{self.database}",
            "REDIS_URL": redis_url,
        }
        self.processes: list[subprocess.Popen[bytes]] = []

    def run(self, *command: str) -> str:
        done = subprocess.run(
            command, cwd=self.root, env=self.env, capture_output=True, text=True, timeout=600, check=False
        )
        assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr}"
        return done.stdout

    def start(self, name: str, *command: str) -> subprocess.Popen[bytes]:
        with open(self.root / f"{name}.log", "ab") as log:
            process = subprocess.Popen(
                command,
                cwd=self.root,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.processes.append(process)
        return process

    def log(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text(errors="replace")

    def worker(self, node: str) -> subprocess.Popen[bytes]:
        celery = str(self.venv / "bin" / "celery")
        process = self.start(node, celery, "-A", self.app, "worker", "-n", node, "-c", "1", "--loglevel=INFO")
        wait_for(lambda: " ready." in self.log(node) or process.poll() is not None, 60, f"{node} to start")
        assert process.poll() is None, self.log(node)
        return process

    def query(self, sql: str, *args: object) -> list[tuple[object, ...]]:
        # A connection's own block only commits: closing() closes it (Python 3.13 warns of one left open).
        with contextlib.closing(sqlite3.connect(self.database, timeout=30)) as conn:
            return conn.execute(sql, args).fetchall()

    def row(self, task_id: str) -> tuple[object, ...] | None:
        found = self.query(
            "SELECT status, worker, result FROM django_celery_results_taskresult WHERE task_id = ?", task_id
        )
        return found[0] if found else None

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)


@pytest.mark.parametrize("artifact", ["wheel", "sdist"])
def test_a_fresh_install_recovers_a_task_whose_worker_was_killed(
    artifact: str, built: dict[str, Path], tmp_path: Path
) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    redis_server = RedisServer(tmp_path / "redis").start()
    project = Project(tmp_path / "project", venv, redis_server.url())
    shutil.copytree(MINIMAL_PROJECT, project.root)
    try:
        project.run(str(venv / "bin" / "python"), "-m", "pip", "install", "-q", str(built[artifact]))
        python = str(venv / "bin" / "python")
        project.run(python, "manage.py", "migrate", "-v", "0")
        project.start(
            "beat", str(venv / "bin" / "celery"), "-A", "proj", "beat", "-S", "django", "--loglevel=INFO"
        )
        first = project.worker("first@install")
        send = "import django; django.setup(); from proj.tasks import slow; print(slow.delay(6).id)"
        sent = project.run(python, "-c", send)
        task_id = sent.split()[-1]
        wait_for(lambda: (project.row(task_id) or ("",))[0] == "STARTED", 60, "the task to start")

        os.killpg(first.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        project.worker("second@install")
        wait_for(lambda: (project.row(task_id) or ("",))[0] == "SUCCESS", 90, "the task to be recovered")
        print(f"{artifact}: recovered and done {time.monotonic() - killed_at:.1f}s after the kill")
    finally:
        project.stop()
        redis_server.stop()

    _, worker, result = project.row(task_id) or ()
    assert (worker, json.loads(str(result))) == ("second@install", 6)
    beat_log = project.log("beat")
    assert "beat: Starting..." in beat_log
    assert "celery_orphans.reconcile" not in beat_log  # no line per sweep sent
    assert project.query(
        "SELECT trigger, evidence FROM celery_orphans_orphanevent WHERE task_id = ? AND action = 'recovered'",
        task_id,
    ) == [("watch", "process_exited")]  # the second worker saw the first one's process gone


def readme_python(containing: str) -> str:
    """The first Python block of the README that holds ``containing``: what a new user copies."""
    for block in re.findall(r"```python\n(.*?)```", (SOURCE / "README.md").read_text(), re.DOTALL):
        if containing in block:
            return str(block)
    raise AssertionError(f"no Python block of the README holds {containing!r}")


CELERY_PY = """import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "mysite.settings")
app = Celery("mysite")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
"""


def test_a_new_users_project_reports_a_misspelled_setting_and_waits_for_its_ledger(
    built: dict[str, Path], tmp_path: Path
) -> None:
    """``django-admin startproject``, the README's settings with SHADOW_MODE misspelled: ``check`` and a
    worker both say so; spelled right, a worker whose ledger is not up yet says so in one line and takes
    its lease once the ledger answers."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    broker = RedisServer(tmp_path / "broker").start()
    ledger = RedisServer(tmp_path / "ledger", password="pw-s3cret")  # started later
    project = Project(tmp_path / "project", venv, broker.url(), app="mysite")
    project.env.update({"DJANGO_SETTINGS_MODULE": "mysite.settings", "LEDGER_URL": ledger.url()})
    project.root.mkdir()
    python = str(venv / "bin" / "python")
    try:
        project.run(python, "-m", "pip", "install", "-q", str(built["wheel"]))
        project.run(str(venv / "bin" / "django-admin"), "startproject", "mysite", ".")
        readme = readme_python("recommended_celery_settings(")
        assert "CELERY_ORPHANS_SHADOW_MODE = True" in readme
        settings_py = project.root / "mysite" / "settings.py"
        settings_py.write_text(
            "import os\n"
            + settings_py.read_text()
            + 'INSTALLED_APPS += ["django_celery_results", "django_celery_beat", "celery_orphans"]\n'
            + readme.replace("CELERY_ORPHANS_SHADOW_MODE", "CELERY_ORPHANS_SHADOWMODE")
            + 'CELERY_BROKER_URL = os.environ["REDIS_URL"]\n'
            + 'CELERY_ORPHANS_REDIS_URL = os.environ["LEDGER_URL"]\n'
        )
        (project.root / "mysite" / "celery.py").write_text(CELERY_PY)
        (project.root / "mysite" / "__init__.py").write_text("from .celery import app as celery_app\n")
        celery = str(venv / "bin" / "celery")

        check = subprocess.run(
            [python, "manage.py", "check"],
            cwd=project.root,
            env=project.env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert check.returncode == 1
        assert "(celery_orphans.E011) The Django setting CELERY_ORPHANS_SHADOWMODE" in check.stderr
        assert "HINT: Did you mean CELERY_ORPHANS_SHADOW_MODE?" in check.stderr

        refused = project.start("refused", celery, "-A", "mysite", "worker", "-n", "refused@new", "-c", "1")
        assert refused.wait(timeout=60) == 78
        assert "worker refused@new will not start" in project.log("refused")
        assert "HINT: Did you mean CELERY_ORPHANS_SHADOW_MODE?" in project.log("refused")

        settings_py.write_text(settings_py.read_text().replace("SHADOWMODE", "SHADOW_MODE"))
        project.run(python, "manage.py", "check")
        project.run(python, "manage.py", "migrate", "-v", "0")
        project.worker("late@new")  # ready, its ledger not up
        ledger.start()
        wait_for(lambda: "taken: its ledger answered" in project.log("late@new"), 30, "the lease")
    finally:
        project.stop()
        broker.stop()
        leases = ledger.client().keys("celery_orphans:lease:late@new:*") if ledger.process else []
        ledger.stop()

    log = project.log("late@new")
    assert len(leases) == 1
    [unreachable] = [line for line in log.splitlines() if "cannot reach its ledger's Redis" in line]
    assert "ERROR/MainProcess] celery-orphans: worker late@new cannot reach" in unreachable
    assert f"its ledger's Redis at 127.0.0.1:{ledger.port} (" in unreachable
    for noise in ("pw-s3cret", "Traceback", "Exception in thread"):
        assert noise not in log
