"""benchmarks/tpu_session.py's readings of what its children wrote: Snakemake's log (each
job's seconds) and pytest's JUnit XML (counts and failures), on texts written here."""

from __future__ import annotations

import sys

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import tpu_session  # noqa: E402

LOG = """\
[Sun Dec  6 06:51:40 2026]
localrule validate:
    input: config/recipes/x.yaml
    jobid: 2
    resources: tmpdir=/tmp
[Sun Dec  6 06:51:41 2026]
rule qualify:
    output: results/computations/0123456789abcdef/qualification/proof.json
    jobid: 6
[Sun Dec  6 06:51:42 2026]
Finished jobid: 2 (Rule: validate)
[Sun Dec  6 06:52:33 2026]
Finished jobid: 6 (Rule: qualify)
[Sun Dec  6 06:52:34 2026]
rule train:
    jobid: 3
"""


def test_job_seconds_pair_each_start_with_its_finish_and_skip_unfinished_jobs():
    assert tpu_session.job_seconds(LOG) == [
        {"rule": "validate", "jobid": 2, "seconds": 2.0},
        {"rule": "qualify", "jobid": 6, "seconds": 52.0},
    ]


def test_junit_counts_and_failures(tmp_path):
    xml = tmp_path / "j.xml"
    xml.write_text(
        '<testsuites><testsuite tests="5" failures="1" errors="1" skipped="1">'
        '<testcase classname="tests.test_a" name="test_ok"/>'
        '<testcase classname="tests.test_a" name="test_bad"><failure message="2 != 3"/></testcase>'
        '<testcase classname="tests.test_b" name="test_err"><error message="boom"/></testcase>'
        '<testcase classname="tests.test_b" name="test_skip"><skipped/></testcase>'
        '<testcase classname="tests.test_b" name="test_ok2"/>'
        "</testsuite></testsuites>"
    )
    out = tpu_session._junit(xml)
    assert out["counts"] == {"tests": 5, "failures": 1, "errors": 1, "skipped": 1, "passed": 2}
    assert out["failed"] == [
        {"test": "tests.test_a::test_bad", "message": "2 != 3"},
        {"test": "tests.test_b::test_err", "message": "boom"},
    ]
