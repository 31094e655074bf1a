"""The tree is lint-clean: `ruff check`, `ruff format --check` and `snakefmt --check` over the
whole repository, `lint-imports` (the import contracts: layers, no circles) and `vulture`
(unused code), so CI's one test command enforces them (settings in pyproject.toml)."""

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

pytestmark = pytest.mark.slow  # each check is a separate process

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
