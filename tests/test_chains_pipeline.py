"""A chain through real Snakemake: the Llama demo's export as the base model of a second
packed-sft recipe (config ``chains``). The link pins the upstream export's files by their
own bytes, the downstream computation is registered under its own digest and runs through
the usual rules, starts from the upstream weights (its prepared base parameters are the
export's tensors), and a rerun has nothing to do. Tiny data, few updates."""

import hashlib
import json
import re
import shutil

import numpy as np
import pytest
import yaml
from conftest import REPO, copy_demo_heads, run_snakemake
from safetensors.numpy import load_file

from minifield import recipe as recipes

pytestmark = pytest.mark.slow  # runs Snakemake

#: the downstream computation's files this test reads
DOWNSTREAM = ("eval/metrics.json", "publication.json", "report/loss.png")
BASE_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _values(arrays) -> np.ndarray:
    """Every parameter value, sorted: equal for the same tensors in any layout or naming."""
    return np.sort(np.concatenate([np.asarray(a, np.float32).ravel() for a in arrays]))


def _tiny(recipe: dict, root, **training) -> dict:
    recipe["training"].update(batch_size=4, warmup_steps=1, **training)
    recipe["limits"] = {"max_steps": 4}
    recipe["checkpoint"] = {"every_steps": 2, "keep": 2}
    # four updates cannot reach the demo's exact-match threshold (tested in test_llama_demo)
    recipe["evaluation"] = {"eval_every": 2}
    for item in recipe["inputs"]:
        item["sha256"] = _sha(root / "data" / item["path"])
    return recipe


def make_project(tmp_path):
    shutil.copytree(REPO / "data" / "llama-base", tmp_path / "data" / "llama-base")
    copy_demo_heads(
        REPO / "data" / "llama-sft-demo",
        tmp_path / "data" / "llama-sft-demo",
        {"train": 40, "dev": 8, "test": 8},
    )
    demo = yaml.safe_load((REPO / "config" / "recipes" / "llama-sft-demo.yaml").read_text())
    recipes_dir = tmp_path / "config" / "recipes"
    recipes_dir.mkdir(parents=True)
    upstream = _tiny(json.loads(json.dumps(demo)), tmp_path)
    downstream = _tiny(json.loads(json.dumps(demo)), tmp_path, learning_rate=0.001, seed=1)
    downstream["job_id"] = "chained-sft"
    (recipes_dir / "first.yaml").write_text(yaml.safe_dump(upstream))
    (recipes_dir / "second.yaml").write_text(yaml.safe_dump(downstream))
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    config["recipes"] = ["config/recipes/first.yaml"]
    config["chains"] = [{"from": "config/recipes/first.yaml", "to": "config/recipes/second.yaml"}]
    config["qualification"]["mode"] = "crash"  # test_proof.py covers both modes
    (tmp_path / "config" / "chain.yaml").write_text(yaml.safe_dump(config))
    return tmp_path


def ran(proc) -> list[str]:
    return re.findall(r"Finished jobid: \d+ \(Rule: (\w+)\)", proc.stdout + proc.stderr)


def test_a_packed_sft_export_is_the_base_of_the_next_recipe(tmp_path):
    project = make_project(tmp_path)
    configfile = ("--configfile", "config/chain.yaml")
    a = recipes.load(project / "config" / "recipes" / "first.yaml").computation_digest[:16]
    written = recipes.load(project / "config" / "recipes" / "second.yaml")
    b = written.computation_digest[:16]

    # what this test reads, in two runs since the downstream digest is known once the link
    # ran: the link (with the upstream computation up to its evaluation, the link's gate),
    # then the downstream computation up to its publication and its loss plot (not the
    # capacity plan nor the other report pages: each stage is a process of its own)
    link = f"results/chains/{a}/{b}/recipe.json"
    first = run_snakemake(project, link, *configfile, check=True)
    concrete = json.loads((project / link).read_text())
    linked = recipes.validate(concrete)
    c = linked.computation_digest[:16]
    read = [link, *(f"results/computations/{c}/{name}" for name in DOWNSTREAM)]
    second = run_snakemake(project, *read, *configfile, check=True)
    assert sorted(ran(first) + ran(second)).count("train") == 2
    assert ran(first).count("chain_link") == 1 and "chain_link" not in ran(second)
    export_dir = project / "results" / "computations" / a / "train" / "export"
    pins = {item["path"]: item["sha256"] for item in concrete["inputs"]}
    for name in BASE_FILES:
        assert pins[f"chain/{name}"] == _sha(export_dir / name), name
    assert not any(path.startswith("llama-base/") for path in pins)
    assert c not in (a, b)

    cdir = project / "results" / "computations" / c
    result = json.loads((cdir / "train" / "result.json").read_text())
    assert (
        result["status"] == "completed"
        and result["computation_digest"] == linked.computation_digest
    )
    assert json.loads((cdir / "qualification" / "proof.json").read_text())["passed"] is True
    assert (
        "dev_exact_match"
        in json.loads((cdir / "eval" / "metrics.json").read_text())["selected_dev"]
    )
    assert (cdir / "publication.json").is_file() and (cdir / "report" / "loss.png").is_file()

    # the downstream computation starts from the upstream export, not from the shipped base
    examples = project / "results" / "examples" / linked.examples_digest[:16]
    prepared = _values(np.load(p) for p in sorted(examples.glob("base.*.npy")))
    exported = _values(load_file(export_dir / "model.safetensors").values())
    shipped = _values(load_file(project / "data" / "llama-base" / "model.safetensors").values())
    assert prepared.shape == exported.shape and np.array_equal(prepared, exported)
    assert not np.array_equal(exported, shipped)

    again = run_snakemake(project, *read, *configfile, "-n", check=True)
    assert "Nothing to be done" in again.stdout + again.stderr

    # an upstream edit: the upstream computation and the link again, into new directories
    path = project / "config" / "recipes" / "first.yaml"
    edited = yaml.safe_load(path.read_text())
    edited["training"]["learning_rate"] = 0.002
    path.write_text(yaml.safe_dump(edited))
    a_new = recipes.load(path).computation_digest[:16]
    plan = run_snakemake(project, *configfile, "-n", check=True)
    text = plan.stdout + plan.stderr
    assert f"results/chains/{a_new}/{b}/recipe.json" in text
    stats = dict(re.findall(r"^(\w+)\s+(\d+)$", text.split("Job stats")[1], re.M))
    assert stats["train"] == "1" and stats["chain_link"] == "1"
