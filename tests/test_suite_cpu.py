"""benchmarks/suite_cpu.py: a process a test starts is counted, with its CPU, under that test.

The run is of a throwaway test file whose one test starts a Python process that spins for a
known CPU time; nothing of the repository's suite runs."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import suite_cpu  # noqa: E402

pytestmark = pytest.mark.slow  # starts pytest, which starts a process

SPINNING_TEST = """
import subprocess, sys

SPIN = "import resource\\nwhile sum(resource.getrusage(resource.RUSAGE_SELF)[:2]) < 0.4: pass"


def test_spins():
    subprocess.run([sys.executable, "-c", SPIN], check=True)
"""


def test_a_started_process_is_counted_under_the_test_that_started_it(tmp_path, monkeypatch, capsys):
    (tmp_path / "test_spin.py").write_text(SPINNING_TEST, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    records = tmp_path / "records.json"
    assert suite_cpu.main(["--json", str(records), "--", "-q", "-p", "no:cacheprovider"]) == 0
    rows = json.loads(records.read_text())
    spun = [r for r in rows if r["test"] == "test_spin.py::test_spins"]
    assert len(spun) == 1 and spun[0]["argv"][0] == "-c", rows
    assert 0.4 <= spun[0]["cpu"] < 2.0  # its own CPU: the spin, and an interpreter's start
    assert suite_cpu.kind(spun[0]) == "python -c (probes, recomputations)"
    session = [r for r in rows if suite_cpu.kind(r) == "pytest (the session)"]
    assert len(session) == 1 and not session[0]["test"]
    printed = capsys.readouterr().out
    assert "test_spin.py" in printed  # the file that started it, in the per-file table
