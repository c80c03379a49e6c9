"""The code map in docs/code-map.md says what the import-linter contract enforces."""

from __future__ import annotations

from pathlib import Path

from tests import code_map

PACKAGE = code_map.PACKAGE


def test_the_docs_layer_table_is_the_one_the_contract_gives():
    assert code_map.documented() == code_map.table(), "run: python -m tests.code_map --write"


def test_every_module_of_the_package_has_a_layer():
    # import-linter's exhaustive contract says so too; this names the module in the test's failure.
    children = {p.stem for p in PACKAGE.iterdir() if p.suffix == ".py" and p.stem != "__init__"}
    children |= {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    layered = {m for layer in code_map.layers() for m in layer.modules}
    assert children == layered


def test_the_worker_side_and_the_sweep_are_independent_siblings():
    (layer,) = [layer for layer in code_map.layers() if "worker" in layer.modules]
    assert layer.independent and set(layer.modules) == {"worker", "sweep"}


def test_the_table_follows_the_contract(tmp_path: Path):
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text(
        'id = "layers"\nlayers = [\n  # Top.\n  "a : b",\n  # Beside.\n  "c | d",\n  "e",\n]\n'
    )

    found = code_map.layers(pyproject)

    assert found == [
        code_map.Layer(("a", "b"), False, "Top."),
        code_map.Layer(("c", "d"), True, "Beside."),
        code_map.Layer(("e",), False, ""),
    ]
    assert "| 2 | `c` \\| `d` | Beside. |" in code_map.table(found)


def test_the_layout_in_the_doc_names_every_module():
    layout = code_map.DOC.read_text().split("## The layout", 1)[1].split("## The layers", 1)[0]
    modules = {
        p.name
        for p in PACKAGE.rglob("*.py")
        if p.name != "__init__.py" and "migrations" not in p.parts and "management" not in p.parts
    }
    assert sorted(m for m in modules if m not in layout) == []
