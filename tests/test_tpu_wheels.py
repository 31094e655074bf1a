"""benchmarks/tpu_wheels.py: the locked packages a TPU host needs, against uv's own export of
the lock (an independent reading of uv.lock's markers for CPython 3.11 on Linux)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import tpu_wheels  # noqa: E402


def _uv_export() -> dict[str, str]:
    """name -> version of every package uv installs for minifield (no dev groups) on CPython
    3.11 x86-64 Linux, markers evaluated by the test (uv writes them beside each line)."""
    from packaging.markers import Marker

    text = subprocess.run(
        ["uv", "export", "--locked", "--no-dev", "--no-hashes", "--no-emit-project",
         "--no-header", "--no-annotate"],
        cwd=REPO, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    found = {}
    for line in text.splitlines():
        requirement, _, marker = line.partition(";")
        if not requirement.strip() or (marker and not Marker(marker).evaluate(
            {**tpu_wheels.ENVIRONMENT, "python_full_version": "3.11.7"}
        )):  # fmt: skip
            continue
        name, version = requirement.strip().split("==")
        found[tpu_wheels._normal(name)] = version
    return found


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("uv") is None, reason="uv is not on PATH")
def test_the_closure_is_what_uv_installs_for_cpython_311_on_linux():
    closure = tpu_wheels.Lock().closure()
    assert {n: p["version"] for n, p in closure.items()} == _uv_export()


def test_carried_wheels_fit_cpython_311_x86_64_and_leave_the_hosts_jax_alone():
    rows = tpu_wheels.carried(tpu_wheels.Lock())
    names = {tpu_wheels._normal(p["name"]) for p, _ in rows}
    assert {"snakemake", "jsonschema", "referencing", "rpds-py"} <= names
    assert not names & (tpu_wheels.ON_THE_HOST | tpu_wheels.FROM_ITS_INDEX)
    for package, wheel in rows:
        filename = wheel["url"].rsplit("/", 1)[-1]
        if filename.endswith(".whl"):
            python, abi, platform = filename[:-4].split("-")[-3:]
            assert python in ("py3", "py2.py3", "cp311") or python.startswith("cp3"), filename
            assert abi in ("none", "abi3", "cp311"), filename
            assert platform == "any" or "x86_64" in platform, filename
        else:  # published as source only: built into a wheel where it is downloaded
            assert filename.endswith(".tar.gz") and not package.get("wheels")
    # what travels stays well inside the 64 MiB a call carries, beside the working tree
    assert sum(w["size"] for _, w in rows) < 40 * 2**20


def test_dry_run_lists_and_downloads_nothing(tmp_path, capsys):
    assert tpu_wheels.main(["download", "--dry-run", "--dest", str(tmp_path / "w")]) == 0
    out = capsys.readouterr().out
    assert "snakemake==9.27.1" in out and "MiB, into" in out
    assert not (tmp_path / "w").exists()
