"""The docs cannot drift from the code: settings tables, check IDs, links, and a strict mkdocs build."""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.checks.registry import registry as check_registry
from django.test import override_settings

from celery_orphans import checks, serializers
from celery_orphans.conf import Setting, Settings
from tests.celery_conf import patch_setting
from tests.helpers import ROOT

DOCS = ROOT / "docs"
TAG = "celery_orphans"


def table(markdown: str, heading: str) -> list[dict[str, str]]:
    """The first Markdown table after ``heading``, one dict per row keyed by the header cells."""
    block: list[str] = []
    for line in markdown.split(heading, 1)[1].splitlines():
        if line.startswith("|"):
            block.append(line)
        elif block:
            break
    assert len(block) > 2, f"no table after {heading!r}"
    header, _, *rows = ([cell.strip() for cell in row.split("|")[1:-1]] for row in block)
    return [dict(zip(header, row)) for row in rows]


def code(cell: str) -> str:
    """The text of the first inline code span in a table cell."""
    found = re.search(r"`([^`]*)`", cell)
    assert found, f"no `code` in {cell!r}"
    return found[1]


def documented_default(cell: str) -> object:
    return ast.literal_eval(code(cell))


def by_name(rows: list[dict[str, str]]) -> dict[str, dict[str, str]]:
    named = {code(row["Setting"]): row for row in rows}
    assert len(named) == len(rows), "a setting is listed twice"
    return named


def settings_by_name() -> dict[str, Setting[object]]:
    return {s.django_name: s for s in Settings().all()}


def same_default(documented: object, actual: object) -> bool:
    # 5.0 and 5 are equal in Python, but the docs should say which type the setting holds.
    return documented == actual and type(documented) is type(actual)


def test_the_settings_reference_lists_every_setting_with_its_default_and_environment_variable():
    rows = by_name(table((DOCS / "settings.md").read_text(), "## Reference"))
    settings = settings_by_name()

    assert sorted(rows) == sorted(settings)
    for name, setting in settings.items():
        row = rows[name]
        default = documented_default(row["Default"])
        assert same_default(default, setting.default), (
            f"{name}: docs say {default!r}, code {setting.default!r}"
        )
        variable, _, example = shlex.split(code(row["Environment variable (example)"]))[0].partition("=")
        assert variable == name
        setting.parse(setting.name, example)  # the example is a value the setting accepts


def test_the_readme_lists_every_setting_with_its_default():
    rows = by_name(table((ROOT / "README.md").read_text(), "## Settings"))
    settings = settings_by_name()

    assert sorted(rows) == sorted(settings)
    for name, setting in settings.items():
        default = documented_default(rows[name]["Default"])
        assert same_default(default, setting.default), f"{name}: README says {default!r}"


def ids_in_checks_module() -> set[str]:
    modules = [*Path(checks.__file__).parent.glob("*.py"), Path(serializers.__file__)]
    source = "".join(module.read_text() for module in modules)
    found = re.findall(r"""["'](?:celery_orphans\.)?([EWI]\d{3})["']""", source)
    return {f"celery_orphans.{code}" for code in found}


def ids_reported_by_bad_configurations(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    from testproject.celery import app

    patch_setting(monkeypatch, app.conf, "task_track_started", False)
    patch_setting(monkeypatch, app.conf, "result_backend", "rpc://")
    found: set[str] = set()
    bad = [
        {"CELERY_ORPHANS_MAX_ATTEMPTS": "many"},
        {"CELERY_ORPHANS_LEASE_SECONDS": 1, "CELERY_ORPHANS_HEARTBEAT_SECONDS": 1},
        {"CELERY_ORPHANS_ATTEMPTS_WINDOW_SECONDS": 1},
    ]
    ours = [c for c in check_registry.registered_checks if TAG in getattr(c, "tags", ())]
    assert ours, "celery-orphans registered no checks"
    for overrides in bad:
        with override_settings(**overrides):
            found |= {m.id for check in ours for m in check(app_configs=None) if m.id}
    return found


def test_every_check_id_is_documented(monkeypatch):
    text = (DOCS / "checks.md").read_text()
    rows = table(text, "# System checks")
    listed = {f"celery_orphans.{code(row['ID'])}" for row in rows if row["Level"] != "retired"}
    retired = {f"celery_orphans.{code(row['ID'])}" for row in rows if row["Level"] == "retired"}
    in_code = ids_in_checks_module()
    reported = ids_reported_by_bad_configurations(monkeypatch)

    assert {"celery_orphans.E001", "celery_orphans.E002", "celery_orphans.E007"} <= reported <= in_code
    assert listed == in_code
    assert not retired & in_code  # an ID is never reused
    for check_id in in_code:
        anchor = check_id.rsplit(".", 1)[1].lower()
        assert f"## `{check_id}` {{#{anchor}}}" in text, f"{check_id} has no section of its own"


def test_how_it_works_keeps_its_decision_diagram():
    text = (DOCS / "how-it-works.md").read_text()
    assert re.search(r"^```mermaid\nflowchart ", text, re.MULTILINE)


def test_every_link_from_the_readme_to_a_file_of_the_repository_resolves():
    text = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\((?!https?://|#)([^)#\s]+)(?:#[^)]*)?\)", text)
    assert targets
    assert [t for t in targets if not (ROOT / t).exists()] == []


def python_block(markdown: str, first_line: str) -> str:
    """The fenced Python block that starts with ``first_line``."""
    pattern = rf"^```python\n({re.escape(first_line)}\n.*?)^```"
    [block] = re.findall(pattern, markdown, re.MULTILINE | re.DOTALL)
    return block


@pytest.mark.parametrize("page", ["quickstart.md", "installation.md"])
def test_the_docs_celery_py_is_the_one_the_test_project_runs(page):
    shown = python_block((DOCS / page).read_text(), "# yourproject/celery.py")
    runs = (ROOT / "testproject" / "testproject" / "celery.py").read_text()

    assert ast.dump(ast.parse(shown.replace("yourproject", "testproject"))) == ast.dump(ast.parse(runs))


def test_the_install_sections_say_where_a_dev_release_comes_from():
    version = re.search(r'^version = "(.+)"$', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    assert version and ".dev" in version[1]  # once released, this test gives way to a PyPI install line
    for text in ((ROOT / "README.md").read_text(), (DOCS / "installation.md").read_text()):
        assert f"`{version[1]}`" in text
        assert "not on PyPI" in text
        assert re.search(r"^pip install \S*/celery-orphans", text, re.MULTILINE)
        assert re.search(r'^pip install "celery-orphans\S* @ git\+https://', text, re.MULTILINE)
        assert not re.search(r"^pip install \"?celery-orphans\"?$", text, re.MULTILINE)


def mkdocs() -> Path:
    return Path(sys.executable).parent / "mkdocs"


def test_the_docs_site_builds_with_mkdocs_strict(tmp_path):
    if not mkdocs().exists():
        pytest.skip(f"mkdocs is not installed in {sys.prefix}: pip install -e '.[docs]' (CI installs it)")
    result = subprocess.run(
        [str(mkdocs()), "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "WARNING" not in result.stderr
