"""The fast tier's guard (tests/conftest.py) on probe tests, in a pytest run of their own."""

import pytest
from conftest import REPO

pytestmark = pytest.mark.slow  # the probe run is a separate pytest process

PROBES = """
import subprocess
import sys

import pytest


def test_unmarked_start():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_unmarked_start_swallowed():
    try:
        subprocess.run([sys.executable, "-c", "pass"], check=True)
    except Exception:
        pass


@pytest.fixture(scope="module")
def started_in_a_fixture():
    return subprocess.run([sys.executable, "-c", "print(7)"], capture_output=True, text=True)


def test_unmarked_start_in_a_module_fixture(started_in_a_fixture):
    assert started_in_a_fixture.stdout == "7\\n"


@pytest.mark.slow
def test_marked_start():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_in_process():
    assert sum(range(4)) == 6
"""


def test_unmarked_tests_that_start_a_process_fail_and_marked_ones_pass(pytester):
    pytester.makeconftest((REPO / "tests" / "conftest.py").read_text())
    pytester.makeini("[pytest]\nmarkers =\n    slow: starts processes\n")
    pytester.makepyfile(test_probes=PROBES)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=2, errors=1)
    result.stdout.fnmatch_lines(  # errors (set-up) are reported before failures
        [
            "*test_unmarked_start_in_a_module_fixture starts a process*but is not marked slow*",
            "*test_unmarked_start starts a process*but is not marked slow*",
            "*test_unmarked_start_swallowed started a process*but is not marked slow",
        ]
    )
    # the fast tier's command leaves out exactly the marked test
    fast = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-m", "not slow")
    fast.assert_outcomes(passed=1, failed=2, errors=1, deselected=1)
