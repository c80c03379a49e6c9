"""The code map's layers, read from the import-linter contract in pyproject.toml.

    python -m tests.code_map --write     # rewrite the layer table in docs/code-map.md from the contract
    python -m tests.code_map --figures   # the import graph by layer (needs import-linter's grimp)
    python -m tests.code_map --figures --source /path/to/a/checkout   # the same for another checkout

tests/test_code_map.py checks that the table in the doc is the one the contract gives.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "code-map.md"
PACKAGE = ROOT / "celery_orphans"
BEGIN = "<!-- layers: made by `python -m tests.code_map --write` from pyproject.toml; do not edit -->"
END = "<!-- end of layers -->"
MAX_MODULE_LINES = 300


@dataclass(frozen=True)
class Layer:
    modules: tuple[str, ...]
    independent: bool  # "a | b": the modules may not import each other
    about: str  # the comment above the layer in the contract


def layers(pyproject: Path = ROOT / "pyproject.toml") -> list[Layer]:
    """The layers of the contract whose id is ``layers``, top first, each with the comment above it."""
    text = pyproject.read_text()
    start = text.index('id = "layers"')
    block = text[text.index("layers = [", start) :]
    block = block[: block.index("\n]")]
    found, about = [], ""
    for line in block.splitlines()[1:]:
        line = line.strip()
        if line.startswith("#"):
            about = line.lstrip("# ").strip()
        elif line.startswith('"'):
            raw = ast.literal_eval(line.rstrip(","))
            independent = "|" in raw
            modules = tuple(m.strip() for m in re.split(r"[|:]", raw))
            found.append(Layer(modules, independent, about))
            about = ""
    return found


def table(found: list[Layer] | None = None) -> str:
    """The Markdown table of the layers, top first."""
    rows = ["| Layer | Modules | What it holds |", "| --- | --- | --- |"]
    for number, layer in enumerate(found or layers(), 1):
        joint = " \\| " if layer.independent else ", "
        names = joint.join(
            f"`{m}/`" if (ROOT / "celery_orphans" / m).is_dir() else f"`{m}`" for m in layer.modules
        )
        rows.append(f"| {number} | {names} | {layer.about} |")
    return "\n".join(rows)


def documented(doc: Path = DOC) -> str:
    """The table as docs/code-map.md has it, between its markers."""
    text = doc.read_text()
    return text[text.index(BEGIN) + len(BEGIN) : text.index(END)].strip()


def write(doc: Path = DOC) -> None:
    text = doc.read_text()
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    doc.write_text(f"{head}{BEGIN}\n\n{table()}\n\n{END}{tail}")


def layer_of(module: str, found: list[Layer]) -> int | None:
    """The index of the layer a module of the package belongs to (by its first name under the package)."""
    parts = module.split(".")
    if len(parts) < 2:
        return None
    for index, layer in enumerate(found):
        if parts[1] in layer.modules:
            return index
    return None


def figures(source: Path = ROOT) -> dict[str, object]:
    """The package's import graph (function-level imports counted) measured against the contract."""
    import grimp  # import-linter's graph builder, in the dev extra

    sys.path.insert(0, str(source))
    try:
        graph = grimp.build_graph("celery_orphans", include_external_packages=False)
    finally:
        sys.path.remove(str(source))
    found = layers()
    between = up = sideways = 0
    upward: list[str] = []
    for importer in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            a, b = layer_of(importer, found), layer_of(imported, found)
            if a is None or b is None or (a == b and importer.split(".")[1] == imported.split(".")[1]):
                continue
            if a == b:
                if found[a].independent:
                    sideways += 1
                    upward.append(f"{importer} -> {imported} (independent siblings)")
                continue
            between += 1
            if a > b:
                up += 1
                upward.append(f"{importer} -> {imported}")
    sizes = {
        str(path.relative_to(source)): len(path.read_text().splitlines())
        for path in (source / "celery_orphans").rglob("*.py")
        if "migrations" not in path.parts
    }
    longest = max(sizes, key=lambda p: sizes[p])
    return {
        "modules": len(sizes),
        "edges between layers": between,
        "upward edges": up,
        "edges between independent siblings": sideways,
        "the wrong-way edges": upward,
        "longest module": f"{longest} ({sizes[longest]} lines)",
        f"modules over {MAX_MODULE_LINES} lines": sorted(p for p, n in sizes.items() if n > MAX_MODULE_LINES),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--write", action="store_true", help="rewrite the table in docs/code-map.md")
    parser.add_argument("--figures", action="store_true", help="measure the import graph")
    parser.add_argument("--source", type=Path, default=ROOT, help="the checkout to measure")
    args = parser.parse_args()
    if args.write:
        write()
    if args.figures:
        for name, value in figures(args.source.resolve()).items():
            if isinstance(value, list):
                print(f"{name}: {len(value)}")
                for item in value:
                    print(f"    {item}")
            else:
                print(f"{name}: {value}")
    if not (args.write or args.figures):
        print(table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
