"""The tree is lint-clean: `ruff check`, `ruff format --check` and `snakefmt --check` over the
whole repository, `lint-imports` (the import contracts: layers, no circles) and `vulture`
(unused code), so CI's one test command enforces them (settings in pyproject.toml); and no
function or class in src/ is longer than the sizes docs/development.md states."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

#: the longest function and class (lines from its `def`/`class`, decorators not counted, to
#: its last line) in src/, as docs/development.md states them
MAX_FUNCTION_LINES, MAX_CLASS_LINES = 100, 200

PYTHON = [sys.executable, "-m"]
CHECKS = {
    "ruff check": [*PYTHON, "ruff", "check", "."],
    "ruff format": [*PYTHON, "ruff", "format", "--check", "."],
    "snakefmt": [*PYTHON, "snakefmt", "--check", "."],
    # import-linter has no `python -m` entry: its console script, beside this interpreter
    "lint-imports": [str(Path(sys.executable).with_name("lint-imports")), "--no-cache"],
    # unused code (paths and the reviewed whitelist in pyproject.toml [tool.vulture])
    "vulture": [*PYTHON, "vulture"],
}


@pytest.mark.slow  # each check is a separate process
@pytest.mark.parametrize("tool", CHECKS)
def test_tree_is_clean(tool):
    proc = subprocess.run(
        CHECKS[tool],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, (
        f"{tool} found problems:\n{proc.stdout[-5000:]}\n{proc.stderr[-3000:]}"
    )


def _too_long(source: str, where: str) -> list[str]:
    """``where:line name (N lines)`` of each function (any depth, methods included) and
    class in ``source`` longer than the limits."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            limit = MAX_CLASS_LINES
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            limit = MAX_FUNCTION_LINES
        else:
            continue
        lines = node.end_lineno - node.lineno + 1
        if lines > limit:
            found.append(f"{where}:{node.lineno} {node.name} ({lines} lines > {limit})")
    return found


def _function(name: str, lines: int, indent: str = "") -> str:
    """The source of a function ``lines`` lines long."""
    return f"{indent}def {name}():\n" + f"{indent}    pass\n" * (lines - 1)


def test_the_size_measure_counts_def_to_last_line():
    assert _too_long(_function("f", MAX_FUNCTION_LINES), "m.py") == []
    decorated = "@decorator\n" + _function("g", MAX_FUNCTION_LINES + 1)
    assert _too_long(decorated, "m.py") == ["m.py:2 g (101 lines > 100)"]
    # a method at the limit in a class one line over it: only the class is too long
    body = _function("h", MAX_FUNCTION_LINES, "    ") + "    y = 0\n" * 100
    assert _too_long("class C:\n" + body, "m.py") == ["m.py:1 C (201 lines > 200)"]


def test_no_function_or_class_in_src_is_too_long():
    found = []
    for path in sorted((REPO / "src").rglob("*.py")):
        found += _too_long(path.read_text(encoding="utf-8"), str(path.relative_to(REPO)))
    assert not found, "split these into helpers that each do one thing:\n" + "\n".join(found)
