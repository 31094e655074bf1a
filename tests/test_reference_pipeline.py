"""Reference log-probabilities as a pipeline product, through real Snakemake: two DPO recipes
that differ only in beta compute one reference (one `reference` job) which both pin by its
sha256 through the reference link (hashlib over the product file in the test); an edit of
the pairs plans a new reference into a new directory. Tiny data; the links only (training a
preference recipe through the pipeline: tests/test_preference_demo_pipeline.py)."""

import hashlib
import json
import re
import shutil

import pytest
import yaml
from conftest import REPO, copy_demo_heads, run_snakemake

from minifield.pipeline import reference_logprobs

pytestmark = pytest.mark.slow  # runs Snakemake

SIZES = {"train": 16, "dev": 8, "test": 8}


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def make_project(tmp_path):
    shutil.copytree(REPO / "data" / "llama-base", tmp_path / "data" / "llama-base")
    copy_demo_heads(REPO / "data" / "preference-demo", tmp_path / "data" / "preference-demo", SIZES)
    demo = yaml.safe_load((REPO / "config" / "recipes" / "preference-demo.yaml").read_text())
    demo["limits"] = {"max_steps": 2}
    demo["training"]["warmup_steps"] = 1
    (tmp_path / "config" / "recipes").mkdir(parents=True)
    for beta in (0.1, 0.5):
        demo["preference"]["beta"] = beta
        (tmp_path / "config" / "recipes" / f"beta-{beta}.yaml").write_text(yaml.safe_dump(demo))
    pin(tmp_path)
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    config["recipes"] = ["config/recipes/beta-0.1.yaml", "config/recipes/beta-0.5.yaml"]
    (tmp_path / "config" / "sweep.yaml").write_text(yaml.safe_dump(config))
    return tmp_path


def pin(project):
    """Every recipe's inputs pinned by the files' sha256 (after an edit of the data)."""
    for path in (project / "config" / "recipes").iterdir():
        recipe = yaml.safe_load(path.read_text())
        for item in recipe["inputs"]:
            item["sha256"] = _sha(project / "data" / item["path"])
        path.write_text(yaml.safe_dump(recipe))


def stats(proc) -> dict:
    text = proc.stdout + proc.stderr
    return dict(re.findall(r"^(\w+)\s+(\d+)$", text.split("Job stats")[1], re.M))


def test_a_beta_sweep_computes_one_reference_and_pins_it(tmp_path):
    project = make_project(tmp_path)
    configfile = ("--configfile", "config/sweep.yaml")
    recipes = [project / "config" / "recipes" / f"beta-{b}.yaml" for b in (0.1, 0.5)]
    written = [reference_logprobs.validated(p).computation_digest[:16] for p in recipes]
    assert written[0] != written[1]  # two computations ...
    plan = run_snakemake(project, *configfile, "-n", check=True)
    assert stats(plan)["reference"] == "1" and stats(plan)["reference_link"] == "2"

    # ... one reference: run the links (and what they need) only
    text = plan.stdout + plan.stderr
    (r,) = set(re.findall(r"results/reference/([0-9a-f]{16})", text))
    links = [f"results/preference/{r}/{b}/recipe.json" for b in written]
    made = run_snakemake(project, *links, *configfile, check=True)
    ran = re.findall(r"Finished jobid: \d+ \(Rule: (\w+)\)", made.stdout + made.stderr)
    assert sorted(ran) == ["reference", "reference_link", "reference_link"]
    product = project / "results" / "reference" / r / "reference.safetensors"
    record = json.loads((product.parent / "reference.json").read_text())
    assert record["digest"].startswith(r) and record["splits"]["dev"]["pairs"] == SIZES["dev"]
    concrete = [json.loads((project / link).read_text()) for link in links]
    for recipe in concrete:
        pins = {i["name"]: (i["path"], i["sha256"]) for i in recipe["inputs"]}
        assert pins["reference"] == ("reference/reference.safetensors", _sha(product))
        root = project / "results" / "preference" / r / written[0] / "inputs"
        assert _sha(root / "reference" / "reference.safetensors") == _sha(product)
    assert concrete[0]["preference"]["beta"] != concrete[1]["preference"]["beta"]

    # an edit of the pairs: a new reference digest, so a new reference job and directory
    dev = project / "data" / "preference-demo" / "dev.jsonl"
    dev.write_text("".join(dev.read_text().splitlines(True)[:-1]))
    pin(project)
    again = run_snakemake(project, *configfile, "-n", check=True)
    text = again.stdout + again.stderr
    (r_new,) = set(re.findall(r"results/reference/([0-9a-f]{16})", text))
    assert r_new != r and stats(again)["reference"] == "1"
    assert product.is_file()  # the old reference stays
