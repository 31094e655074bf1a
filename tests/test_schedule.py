"""The suite's schedule (tests/conftest.py): a session fixture is built once per xdist worker,
so every test file that reads a session run must be in that run's unit, or a second worker
builds the whole pipeline again (tests/test_accelerator.py did: the linear demo twice)."""

import ast

import conftest
import pytest
from conftest import REPO

#: each session run and the unit its readers are scheduled in (``conftest.work_unit``)
SESSION_RUNS = {
    "linear_demo_run": "tests/test_proof_verdict.py",
    "readme_pipeline_run": "tests/test_readme_commands.py",
}


def readers(fixture: str) -> set[str]:
    """The test files with a function (a test or a fixture) that takes ``fixture``."""
    found = set()
    for path in sorted((REPO / "tests").glob("test_*.py")):
        source = path.read_text(encoding="utf-8")
        if fixture not in source:  # parsing every file is most of this tier test's time
            continue
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef) and fixture in {a.arg for a in node.args.args}:
                found.add(path.relative_to(REPO).as_posix())
    return found


@pytest.mark.parametrize("fixture", SESSION_RUNS)
def test_every_reader_of_a_session_run_is_scheduled_in_its_unit(fixture):
    found = readers(fixture)
    assert SESSION_RUNS[fixture] in found  # the unit's own file reads it too
    assert {path: conftest.work_unit(path) for path in found} == dict.fromkeys(
        found, SESSION_RUNS[fixture]
    )
