"""Mixtures through a real Snakemake run.

- Two recipes mixing one source with different others prepare that source once: the second
  run lists no job for it and leaves its prepared files as they were (mtimes), while its own
  new source is prepared.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
import yaml
from conftest import run_snakemake
from test_mixtures import mixed_recipe, mixture_inputs

from minifield import recipe as recipes
from minifield.digest import short
from minifield.strategies.packed_sft import sft_data

pytestmark = pytest.mark.slow


def _project(workdir: Path, recipes_by_file: dict[str, dict]) -> None:
    (workdir / "config" / "recipes").mkdir(parents=True, exist_ok=True)
    for name, recipe in recipes_by_file.items():
        (workdir / "config" / "recipes" / name).write_text(yaml.safe_dump(recipe))
    config = yaml.safe_load((Path(__file__).parents[1] / "config" / "config.yaml").read_text())
    config["recipes"] = [f"config/recipes/{name}" for name in recipes_by_file]
    config["input_root"] = "in"
    (workdir / "config" / "config.yaml").write_text(yaml.safe_dump(config))


def _jobs(stdout_and_err: str) -> dict[str, int]:
    """Rule → job count from Snakemake's "Job stats" table."""
    table = stdout_and_err.split("Job stats:", 1)[1].split("\n\n", 1)[0]
    return {m[1]: int(m[2]) for m in re.finditer(r"^(\w+)\s+(\d+)$", table, re.MULTILINE)}


def _examples_target(workdir: Path, name: str) -> str:
    loaded = recipes.load(workdir / "config" / "recipes" / name)
    return f"results/examples/{short(loaded.examples_digest)}/manifest.json"


def test_a_source_shared_by_two_mixtures_is_prepared_once(tmp_path):
    workdir = tmp_path / "project"
    space = mixture_inputs(workdir)
    first = mixed_recipe(space)  # train (3) + extra (1)
    other = sft_data.to_jsonl(sft_data.demo_examples(seed=13, sizes={"train": 30})["train"])
    (workdir / "in" / "sft" / "other.jsonl").write_bytes(other)
    second = mixed_recipe(space, [{"input": "extra", "weight": 1}, {"input": "other", "weight": 2}])
    second["job_id"] = "mix-two"
    second["inputs"] = [i for i in second["inputs"] if i["name"] != "train"]
    second["inputs"].append(
        {"name": "other", "path": "sft/other.jsonl", "sha256": hashlib.sha256(other).hexdigest()}
    )

    _project(workdir, {"first.yaml": first})
    done = run_snakemake(workdir, _examples_target(workdir, "first.yaml"), check=True)
    assert _jobs(done.stdout + done.stderr)["prepare_source"] == 2
    sources = workdir / "results" / "sources"
    prepared = {p: p.stat().st_mtime_ns for p in sources.rglob("*") if p.is_file()}
    first_digests = recipes.load(workdir / "config" / "recipes" / "first.yaml").source_digests

    _project(workdir, {"first.yaml": first, "second.yaml": second})
    second_digests = recipes.load(workdir / "config" / "recipes" / "second.yaml").source_digests
    assert second_digests["extra"] == first_digests["extra"]
    done = run_snakemake(workdir, _examples_target(workdir, "second.yaml"), check=True)
    jobs = _jobs(done.stdout + done.stderr)
    assert jobs["prepare_source"] == 1 and jobs["prepare"] == 1  # only "other", new
    assert {p: p.stat().st_mtime_ns for p in prepared} == prepared  # nothing rewritten
    made = sorted(p.name for p in sources.iterdir())
    expected = {short(d) for d in [*first_digests.values(), *second_digests.values()]}
    assert made == sorted(expected) and len(made) == 3
    # the second recipe's examples hold the shared source's rows as prepared the first time
    manifest = json.loads((workdir / _examples_target(workdir, "second.yaml")).read_text())
    shared = json.loads((sources / short(first_digests["extra"]) / "manifest.json").read_text())
    assert manifest["meta"]["mixture"]["extra"] == shared["meta"]["stats"]
