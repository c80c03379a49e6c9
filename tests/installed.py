"""Run the test suite against the installed package instead of this checkout's ``celery_orphans/``.

    python tests/installed.py [pytest arguments]

tox installs the built wheel, then runs this: it copies the checkout without ``celery_orphans/`` to a
temporary directory and runs pytest there, so every import of the package, in the tests and in the
workers and commands they start, finds the wheel's files. The suite checks it (tests/conftest.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LEFT_OUT = {"celery_orphans", ".git", ".venv", ".tox", ".demo", "site", "dist", "build"}


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="celery-orphans-suite-") as tmp:
        suite = Path(tmp) / "suite"
        shutil.copytree(
            ROOT,
            suite,
            ignore=lambda directory, names: LEFT_OUT & set(names) if Path(directory) == ROOT else set(),
        )
        # The checkout stays where the tests that build the package from source find it.
        env = {**os.environ, "TEST_CELERY_ORPHANS_INSTALLED": "1", "TEST_CELERY_ORPHANS_CHECKOUT": str(ROOT)}
        return subprocess.call([sys.executable, "-m", "pytest", *sys.argv[1:]], cwd=suite, env=env)


if __name__ == "__main__":
    sys.exit(main())
