"""The tree is lint-clean: `ruff check`, `ruff format --check` and `snakefmt --check` over the
whole repository, so CI's one test command enforces them (settings in pyproject.toml)."""

import subprocess
import sys

import pytest
from conftest import REPO

pytestmark = pytest.mark.slow  # each check is a separate process

CHECKS = {
    "ruff check": ["ruff", "check", "."],
    "ruff format": ["ruff", "format", "--check", "."],
    "snakefmt": ["snakefmt", "--check", "."],
}


@pytest.mark.parametrize("tool", CHECKS)
def test_tree_is_clean(tool):
    proc = subprocess.run(
        [sys.executable, "-m", *CHECKS[tool]],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, (
        f"{tool} found problems:\n{proc.stdout[-5000:]}\n{proc.stderr[-3000:]}"
    )
