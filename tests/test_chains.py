"""Chains in process: a downstream recipe's model.base replaced by an upstream export's files
(pins from hashlib over the files, not from the code), the refusals, the linked input root,
and the config checks. The real Snakemake run is tests/test_chains_pipeline.py."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import yaml
from conftest import REPO

from minifield import recipe as recipes
from minifield.inputs import linked_root
from minifield.inputs.linked_root import LinkError
from minifield.pipeline import chains, computations
from minifield.state import export
from minifield.strategies.lm import chain_base

DEMO = REPO / "config" / "recipes" / "llama-sft-demo.yaml"
EXPORT_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def fake_export(directory: Path) -> Path:
    """An HF-directory export: distinct bytes per file, listed by the project's writer."""
    directory.mkdir(parents=True)
    for index, name in enumerate(EXPORT_FILES):
        (directory / name).write_bytes(f"upstream file {index}: {name}\n".encode())
    (directory / "dev.jsonl").write_text('{"prompt": "a", "response": "b"}\n')
    export.write_files(directory, {"strategy": {"name": "packed-sft", "version": "12.0.0"}})
    return directory


def written() -> dict:
    return yaml.safe_load(DEMO.read_text())


def test_the_export_replaces_every_base_input_pinned_by_its_own_bytes(tmp_path):
    directory = fake_export(tmp_path / "export")
    template = written()
    concrete = chain_base.base_recipe(template, directory)
    pins = {item["name"]: (item["path"], item["sha256"]) for item in concrete["inputs"]}
    expected = {
        "base-config": "config.json",
        "base-weights": "model.safetensors",
        "base-tokenizer": "tokenizer.json",
        "base-tokenizer-config": "tokenizer_config.json",
    }
    for name, file in expected.items():
        assert pins[name] == (f"chain/{file}", _sha(directory / file)), name
    # the data stay as written; the export's generation_config is not pinned (the recipe
    # as written names none), nor its DEV file
    for item in template["inputs"][:3]:
        assert pins[item["name"]] == (item["path"], item["sha256"])
    assert len(concrete["inputs"]) == len(template["inputs"])
    assert concrete["model"]["base"] == template["model"]["base"]
    assert template == written()  # the template is not modified
    # the concrete recipe is valid and its own computation (the export is in its digest)
    linked = recipes.validate(concrete)
    assert linked.computation_digest != recipes.validate(template).computation_digest
    assert linked.examples_digest != recipes.validate(template).examples_digest


def test_a_sharded_base_becomes_the_exports_single_file(tmp_path):
    directory = fake_export(tmp_path / "export")
    template = written()
    template["inputs"] += [
        {"name": "shard-2", "path": "llama-base/b.safetensors", "sha256": "0" * 64},
        {"name": "index", "path": "llama-base/model.safetensors.index.json", "sha256": "1" * 64},
    ]
    template["model"]["base"].update(weights=["base-weights", "shard-2"], index="index")
    template["model"]["base"]["generation_config"] = "base-tokenizer-config"
    concrete = chain_base.base_recipe(template, directory)
    names = {item["name"]: item for item in concrete["inputs"]}
    assert "shard-2" not in names and "index" not in names
    assert concrete["model"]["base"]["weights"] == ["base-weights"]
    assert "index" not in concrete["model"]["base"]


def test_a_sharded_export_becomes_a_sharded_base_pinned_shard_by_shard(tmp_path):
    directory = tmp_path / "export"
    fake_export(directory)
    (directory / "model.safetensors").unlink()
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    for index, name in enumerate(shards):
        (directory / name).write_bytes(f"shard {index}\n".encode())
    weight_map = {"a.weight": shards[0], "b.weight": shards[1], "c.weight": shards[1]}
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 3}, "weight_map": weight_map})
    )
    export.write_files(directory, {"strategy": {"name": "packed-sft", "version": "12.0.0"}})
    template = written()
    concrete = chain_base.base_recipe(template, directory)
    base = concrete["model"]["base"]
    assert base["weights"] == ["base-weights", "base-weights-2"]
    assert base["index"] == "base-weights-index"
    pins = {item["name"]: (item["path"], item["sha256"]) for item in concrete["inputs"]}
    files = {
        "base-weights": shards[0],
        "base-weights-2": shards[1],
        "base-weights-index": "model.safetensors.index.json",
        "base-config": "config.json",
    }
    for name, file in files.items():
        assert pins[name] == (f"chain/{file}", _sha(directory / file)), name
    assert len(concrete["inputs"]) == len(template["inputs"]) + 2
    recipes.validate(concrete)  # packed-sft accepts the inputs its base names
    root = tmp_path / "linked"
    linked_root.make(concrete, REPO / "data", directory, chain_base.PRODUCT_DIR, root)
    for item in concrete["inputs"]:
        assert _sha(root / item["path"]) == item["sha256"], item["name"]


def test_a_recipe_naming_a_generation_config_pins_the_exports(tmp_path):
    directory = fake_export(tmp_path / "export")
    template = written()
    template["inputs"].append(
        {"name": "base-generation", "path": "llama-base/generation_config.json", "sha256": "2" * 64}
    )
    template["model"]["base"]["generation_config"] = "base-generation"
    concrete = chain_base.base_recipe(template, directory)
    pinned = {item["name"]: item for item in concrete["inputs"]}["base-generation"]
    assert pinned["sha256"] == _sha(directory / "generation_config.json")


def test_refusals_name_the_file(tmp_path):
    directory = fake_export(tmp_path / "export")
    (directory / "model.safetensors").write_bytes(b"tampered")
    with pytest.raises(LinkError, match=r"export/model\.safetensors: sha256 .* model\.json lists"):
        chain_base.base_recipe(written(), directory)
    with pytest.raises(LinkError, match=r"missing/model\.json: missing"):
        chain_base.base_recipe(written(), tmp_path / "missing")
    npy = tmp_path / "npy"
    export.write(npy, {"w": __import__("numpy").zeros(2)}, {})
    with pytest.raises(LinkError, match=r"npy/model\.json: not an HF-directory export record"):
        chain_base.base_recipe(written(), npy)
    partial = fake_export(tmp_path / "partial")
    record = json.loads((partial / "model.json").read_text())
    record["files"] = [f for f in record["files"] if f["file"] != "tokenizer.json"]
    (partial / "model.json").write_text(json.dumps(record))
    with pytest.raises(LinkError, match=r"partial/tokenizer\.json: the export's model\.json lists"):
        chain_base.base_recipe(written(), partial)
    no_base = written()
    del no_base["model"]["base"]
    with pytest.raises(LinkError, match="has no model.base"):
        chain_base.base_recipe(no_base, fake_export(tmp_path / "other"))


def test_the_linked_root_holds_the_data_and_the_exports_files(tmp_path):
    directory = fake_export(tmp_path / "export")
    concrete = chain_base.base_recipe(written(), directory)
    root = tmp_path / "linked"
    linked_root.make(concrete, REPO / "data", directory, chain_base.PRODUCT_DIR, root)
    for item in concrete["inputs"]:
        assert _sha(root / item["path"]) == item["sha256"], item["name"]
    assert sorted(p.name for p in (root / "chain").iterdir()) == sorted(
        ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    )


def test_config_links_are_checked_before_anything_runs(tmp_path):
    no_base_path = REPO / "config" / "recipes" / "sft-demo.yaml"  # packed-sft, no base
    config = {"recipes": [str(DEMO)]}
    found = computations.load_computations(config)
    config["chains"] = [
        {"from": str(DEMO), "to": str(DEMO)},
        {"from": "config/recipes/other.yaml", "to": str(DEMO)},
        {"from": str(DEMO), "to": str(no_base_path)},
    ]
    with pytest.raises(chains.LinkConfigError) as info:
        chains.load_links(config, found)
    message = str(info.value)
    assert "chains[1].from: config/recipes/other.yaml is not one of recipes" in message
    assert "chains[2]: has no model.base for the upstream export to replace" in message
    assert "chains[0]" not in message
    config["chains"] = config["chains"][:1]
    (link,) = chains.load_links(config, found)
    digest = recipes.load(DEMO).computation_digest[:16]
    assert link.directory == f"results/chains/{digest}/{digest}"
    assert link.recipe_path.endswith("/recipe.json") and link.kind.rule == "chain_link"
