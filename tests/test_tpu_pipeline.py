"""The TPU chip as one Snakemake resource: with config ``tpu: 1`` the jobs that open the
accelerator request ``tpu``, the others do not, and the default profile lets one hold it at a
time (libtpu lets one process hold the chip)."""

from __future__ import annotations

import re
import shutil

import pytest
import yaml
from conftest import REPO, run_snakemake

#: the rules whose jobs start processes that open the accelerator (the others keep off it)
CHIP_RULES = {"qualify", "train", "evaluate"}


def test_the_default_profile_lets_one_job_hold_the_chip():
    profile = yaml.safe_load((REPO / "profiles" / "default" / "config.yaml").read_text())
    assert "tpu=1" in profile["resources"]


@pytest.mark.slow
def test_jobs_that_open_the_chip_request_it_and_no_others(tmp_path):
    (tmp_path / "config" / "recipes").mkdir(parents=True)
    shutil.copytree(REPO / "data" / "linear", tmp_path / "data" / "linear")
    shutil.copy(REPO / "config" / "recipes" / "linear-demo.yaml", tmp_path / "config" / "recipes")
    config = {"recipes": ["config/recipes/linear-demo.yaml"], "input_root": "data", "tpu": 1}
    (tmp_path / "config" / "config.yaml").write_text(yaml.safe_dump(config))
    proc = run_snakemake(tmp_path, "-n")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    blocks = re.findall(r"rule (\w+):\n(.*?)(?=\n\s*\n|\Z)", proc.stdout + proc.stderr, re.S)
    requested = {rule for rule, block in blocks if re.search(r"resources: .*\btpu=1\b", block)}
    seen = {rule for rule, _ in blocks}
    assert {"qualify", "train", "evaluate", "validate", "prepare", "publish"} <= seen
    assert requested == CHIP_RULES & seen
