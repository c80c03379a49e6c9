"""The public names of ``celery_orphans``: listed once, and the imports for type checkers agree."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import celery_orphans

INIT = Path(celery_orphans.__file__)


def imported_for_type_checkers() -> dict[str, str]:
    """The names the ``if TYPE_CHECKING:`` block of ``__init__.py`` imports, with their modules."""
    tree = ast.parse(INIT.read_text())
    [block] = [n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"]
    return {
        alias.name: node.module.removeprefix("celery_orphans.")
        for node in block.body
        if isinstance(node, ast.ImportFrom) and node.module
        for alias in node.names
    }


def test_the_type_checkers_imports_name_every_public_name_from_its_home():
    assert imported_for_type_checkers() == celery_orphans._HOMES


def test_every_public_name_is_exported_and_is_the_object_of_its_home():
    assert sorted(celery_orphans.__all__) == sorted(["__version__", *celery_orphans._HOMES])
    for name, home in celery_orphans._HOMES.items():
        assert getattr(celery_orphans, name) is getattr(
            importlib.import_module(f"celery_orphans.{home}"), name
        )
        assert name in dir(celery_orphans)


def test_importing_the_package_loads_none_of_its_modules():
    # A settings module imports it before Django's apps are ready.
    code = (
        "import sys, celery_orphans; print(sorted(m for m in sys.modules if m.startswith('celery_orphans.')))"
    )
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)

    assert shown.stdout.strip() == "[]"
