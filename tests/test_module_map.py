"""The module map in docs/development.md matches the tree under src/minifield/: every
top-level module or package has a row, every module inside a package is named in its
package's row, and no row names something that is not there."""

import re

from conftest import REPO

PACKAGE = REPO / "src" / "minifield"


def _map_rows() -> dict[str, str]:
    """First cell of each row (the names, backticks removed) -> the whole row."""
    text = (REPO / "docs" / "development.md").read_text(encoding="utf-8")
    section = text.split("## Module map (`src/minifield/`)", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = line.split("|")
        if len(cells) < 3 or set(cells[1].strip()) <= {"-"} or "module or package" in line:
            continue
        rows[cells[1]] = line
    return rows


def _named(cell: str) -> set[str]:
    return set(re.findall(r"`([\w/]+)`", cell))


def test_every_top_level_entry_has_a_row_and_every_row_exists():
    rows = _map_rows()
    named = set().union(*(_named(cell) for cell in rows))
    top = {
        path.name + "/" if path.is_dir() else path.stem
        for path in PACKAGE.iterdir()
        if path.name not in ("__init__.py", "__pycache__")
    }
    assert named == top, (
        f"docs/development.md module map: missing {sorted(top - named)}, "
        f"not in the tree {sorted(named - top)}"
    )


def test_every_module_inside_a_package_is_named_in_its_row():
    rows = _map_rows()
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if len(relative.parts) == 1 or path.name == "__init__.py":
            continue
        top = relative.parts[0] + "/"
        [row] = [line for cell, line in rows.items() if top in _named(cell)]
        if not re.search(rf"\b{path.stem}\b", row.split("|", 2)[2]):
            missing.append(str(relative))
    assert not missing, f"docs/development.md module map does not name {missing}"
