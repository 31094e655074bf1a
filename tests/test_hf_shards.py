"""HF exports by shards (``evaluation.export_max_shard_size``): planned, named and indexed as
Hugging Face writes them, loaded back by safetensors, transformers' shard resolver and this
project's readers.

References, none of them this project's code: huggingface_hub's own planner
(``split_state_dict_into_shards_factory``, what ``save_pretrained`` calls) and its
``parse_size_to_int``; the PyTorch ``state_dict()`` order read from transformers' modeling
sources with ``ast`` (the order each ``__init__`` registers its modules); safetensors' loader;
transformers' ``get_checkpoint_shard_files``. transformers' Flax ``from_pretrained`` refuses
a sharded safetensors directory ("coming soon", 4.57) and PyTorch is not installed, so the
logits are checked through this project's loader against the unsharded export's.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import tracemalloc
from pathlib import Path

import jax
import numpy as np
import pytest
from export_shards_probe import random_params
from family_reference import BASE, GEMMA2, PHI3, QWEN2, QWEN3
from safetensors.numpy import load_file, save
from test_hf_export import GPT_SECTION, TINY_LLAMA, _write_export, evaluation_digest
from test_mixtral import MIXTRAL
from test_moe_families import OLMOE, QWEN2_MOE

from minifield import recipe as recipes
from minifield.hf import checkpoint as hf_checkpoint
from minifield.hf import config as hf_config
from minifield.hf import shards
from minifield.models import llama
from minifield.models.expert_slots import at
from minifield.state import export
from minifield.strategies.lm.export_format import ExportedModel


def _hub():
    from huggingface_hub.serialization._base import (
        parse_size_to_int,
        split_state_dict_into_shards_factory,
    )

    return parse_size_to_int, split_state_dict_into_shards_factory


def test_max_shard_size_is_read_as_huggingface_hub_reads_it():
    parse_size_to_int, _ = _hub()
    for text in ("5GB", "500MB", "1.5KB", " 2 kb", "3Tb", "0.25GB", "7KB"):
        assert shards.parse_size(text) == parse_size_to_int(text), text
    assert shards.parse_size(4096) == 4096
    for bad in ("5GiB", "GB", "-1KB", "five MB", "1e3KB", "", 0, -5, True, 1.5, None):
        with pytest.raises(ValueError, match=r"expected|at least one byte"):
            shards.parse_size(bad)


def numpy_params(seed=0, **changes):
    """A tiny Llama's config and random FP32 parameters made with numpy from the tensor
    table's shapes (no JAX initialisation: these tests only write and read files)."""
    cfg = llama.LlamaConfig(**{**TINY_LLAMA, **changes})
    return cfg, random_params(cfg, seed)


def _written(directory: Path) -> dict[str, np.ndarray]:
    """Every tensor of a written HF directory, read by safetensors file by file."""
    out: dict[str, np.ndarray] = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors = load_file(str(path))
        assert not set(tensors) & set(out)
        out.update(tensors)
    return out


def test_tiny_shards_are_what_huggingface_hub_plans_and_hold_the_single_files_tensors(tmp_path):
    _, split = _hub()
    cfg, params = numpy_params(qkv_bias=True)
    hf_checkpoint.write(tmp_path / "one", cfg, params)
    for size in ("20KB", "9KB", 4000):
        directory = tmp_path / str(size)
        hf_checkpoint.write(directory, cfg, params, max_shard_size=shards.parse_size(size))
        single = load_file(str(tmp_path / "one" / "model.safetensors"))
        state_dict = {name: single[name] for name in shards.torch_order(single)}
        reference = split(
            state_dict,
            get_storage_size=lambda t: t.nbytes,
            filename_pattern="model{suffix}.safetensors",
            max_shard_size=size,
        )
        assert reference.is_sharded
        index = json.loads((directory / shards.INDEX_FILE).read_text())
        assert index["weight_map"] == reference.tensor_to_filename
        assert index["metadata"] == {
            "total_size": reference.metadata["total_size"],
            "total_parameters": sum(t.size for t in single.values()),
        }
        # transformers writes the index so (modeling_utils.save_pretrained)
        text = json.dumps(index, indent=2, sort_keys=True) + "\n"
        assert (directory / shards.INDEX_FILE).read_text() == text
        files = {p.name for p in directory.glob("*.safetensors")}
        assert files == set(reference.filename_to_tensors)
        for file, names in reference.filename_to_tensors.items():
            assert sorted(load_file(str(directory / file))) == sorted(names)
        written = _written(directory)
        assert written.keys() == single.keys()
        for name, value in single.items():
            np.testing.assert_array_equal(written[name], value, err_msg=name)
            assert written[name].dtype == value.dtype
    # a limit the model fits in: the single file, byte for byte
    hf_checkpoint.write(tmp_path / "fits", cfg, params, max_shard_size=shards.parse_size("5GB"))
    assert sorted(p.name for p in (tmp_path / "fits").iterdir()) == [
        "config.json",
        "model.safetensors",
    ]
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "fits" / name).read_bytes() == (tmp_path / "one" / name).read_bytes()


# -- the PyTorch state_dict order, from transformers' sources -------------------------------------


def _registration_order(module_file: Path, layer_class: str, prefix: str) -> list[str]:
    """Tensor paths of one decoder layer in the order ``__init__`` registers them, read from
    transformers' source: ``nn.Linear`` gives ``weight, bias``, ``nn.Parameter`` its own name,
    a class of the same file its own tensors under the attribute, ``nn.ModuleList([C(...) for
    ...])`` ``{j}`` then C's, a ``*_CLASSES[...]`` table the file's ``<prefix>Attention``."""
    tree = ast.parse(module_file.read_text())
    classes = {c.name: c for c in tree.body if isinstance(c, ast.ClassDef)}

    def of_call(call: ast.Call) -> list[str] | None:
        func = call.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if name == "Linear":
            return ["weight", "bias"]
        if name == "Embedding":
            return ["weight"]
        if name == "Parameter":
            return [""]
        if name == "ModuleList" and call.args and isinstance(call.args[0], ast.ListComp):
            inner = of_call(call.args[0].elt)
            return None if inner is None else [f"{{j}}.{p}" for p in inner]
        if isinstance(func, ast.Subscript):
            return walk(f"{prefix}Attention")
        return walk(name) if name in classes else None

    def walk(name: str) -> list[str]:
        init = next(f for f in classes[name].body if getattr(f, "name", "") == "__init__")
        assigns = sorted(
            (n for n in ast.walk(init) if isinstance(n, ast.Assign)), key=lambda n: n.lineno
        )
        out = []
        for node in assigns:
            target = node.targets[0]
            if not (isinstance(target, ast.Attribute) and isinstance(node.value, ast.Call)):
                continue
            inner = of_call(node.value)
            out += [f"{target.attr}.{p}" if p else target.attr for p in inner or []]
        return out

    return walk(layer_class)


#: model_type -> (transformers' module, class prefix)
_SOURCES = {
    "llama": ("llama", "Llama"),
    "qwen2": ("qwen2", "Qwen2"),
    "qwen3": ("qwen3", "Qwen3"),
    "phi3": ("phi3", "Phi3"),
    "gemma2": ("gemma2", "Gemma2"),
    "mixtral": ("mixtral", "Mixtral"),
    "qwen2_moe": ("qwen2_moe", "Qwen2Moe"),
    "olmoe": ("olmoe", "Olmoe"),
}


#: model_type -> a tiny config.json of that family
_FAMILIES = {
    "llama": {**BASE, "model_type": "llama"},
    "qwen2": QWEN2,
    "qwen3": QWEN3,
    "phi3": PHI3,
    "gemma2": GEMMA2,
    "mixtral": MIXTRAL,
    "qwen2_moe": QWEN2_MOE,
    "olmoe": OLMOE,
}


@pytest.mark.parametrize("model_type", list(_FAMILIES))
def test_tensors_are_sharded_in_the_pytorch_state_dict_order(model_type):
    hf = _FAMILIES[model_type]
    import transformers

    module, prefix = _SOURCES[model_type]
    source = Path(transformers.__file__).parent / "models" / module / f"modeling_{module}.py"
    layer = _registration_order(source, f"{prefix}DecoderLayer", prefix)
    cfg = hf_config.config_from_hf(hf, max_len=32)
    names = list(hf_checkpoint.expected_tensors(cfg))
    experts = range(max(cfg.n_experts, 1))
    # {j} expanded expert by expert, each expert's matrices together (ModuleList order)
    reference = ["model.embed_tokens.weight"]
    for i in range(cfg.n_layers):
        done_groups = set()
        for path in layer:
            if "{j}" not in path:
                reference.append(f"model.layers.{i}.{path}")
                continue
            group = path.split("{j}")[0]
            if group in done_groups:
                continue
            done_groups.add(group)
            members = [p for p in layer if p.startswith(group + "{j}")]
            for j in experts:
                reference += [f"model.layers.{i}.{p}".format(j=j) for p in members]
    reference += ["model.norm.weight", "lm_head.weight"]
    assert set(names) <= set(reference), sorted(set(names) - set(reference))
    assert shards.torch_order(names) == [n for n in reference if n in names]


# -- readers -------------------------------------------------------------------------------------


def test_a_sharded_export_loads_as_the_single_file_one(tmp_path):
    from transformers.utils.hub import get_checkpoint_shard_files

    cfg, params = _write_export(tmp_path / "one")
    _write_export(tmp_path / "many", max_shard_size=6000)
    many = tmp_path / "many"
    index = many / shards.INDEX_FILE
    shard_files, metadata = get_checkpoint_shard_files(str(many), str(index))
    assert len(shard_files) > 3
    listed = {f["file"] for f in json.loads((many / export.MODEL_FILE).read_text())["files"]}
    assert {Path(f).name for f in shard_files} | {shards.INDEX_FILE} <= listed
    assert "model.safetensors" not in listed
    merged = {}
    for file in shard_files:
        merged.update(load_file(file))
    assert sorted(merged) == sorted(metadata["all_checkpoint_keys"])
    single = load_file(str(tmp_path / "one" / "model.safetensors"))
    assert merged.keys() == single.keys()
    for name, value in single.items():
        np.testing.assert_array_equal(merged[name], value, err_msg=name)

    one, sharded = ExportedModel(tmp_path / "one"), ExportedModel(many)
    assert sharded.cfg == one.cfg == cfg
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(one.params),
        jax.tree_util.tree_leaves(sharded.params),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(path))
    ids = one.prompt_ids("abc")
    np.testing.assert_array_equal(one.logits([ids]), sharded.logits([ids]))

    # every shard is verified: a changed byte in one is named
    shard = Path(shard_files[1])
    shard.write_bytes(shard.read_bytes()[:-1] + b"\x07")
    with pytest.raises(export.ExportError, match=rf"{shard.name}: sha256 mismatch"):
        ExportedModel(many)


def test_writing_holds_the_tensors_being_converted_never_a_file(tmp_path):
    cfg, params = numpy_params(d_model=128, n_layers=16, d_ff=256)
    sizes = [4 * np.asarray(x).size for x in jax.tree_util.tree_leaves(params)]
    total, largest = sum(sizes), max(sizes)
    threads = min(len(os.sched_getaffinity(0)), 8)  # the reading pool's

    def peak(directory: Path, size) -> int:
        tracemalloc.start()
        try:
            hf_checkpoint.write(directory, cfg, params, max_shard_size=size)
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    whole = peak(tmp_path / "one", None)
    sharded = peak(tmp_path / "many", 150_000)
    assert len(list((tmp_path / "many").glob("*.safetensors"))) > 8
    # each thread: the tensor it converts (its source is the caller's), beside a task's
    # bookkeeping (about 1 KB) a tensor; a writer that held a file's converted tensors, or
    # serialised it in memory, would hold the model here
    bound = 2 * threads * largest + 2048 * len(sizes)
    for held in (whole, sharded):
        assert held < bound, (held, threads, largest)
        assert held < total / 4, (held, total)
    # the bytes the safetensors library writes from the whole tensors
    whole_tensors = {}
    for name, (internal, transpose, _) in hf_checkpoint.expected_tensors(cfg).items():
        value = np.asarray(at(params, internal), np.float32)
        whole_tensors[name] = np.ascontiguousarray(value.T if transpose else value)
    written = (tmp_path / "one" / "model.safetensors").read_bytes()
    assert written == save(whole_tensors, metadata={"format": "pt"})


# -- the recipe key ------------------------------------------------------------------------------


def test_export_max_shard_size_keeps_old_digests_and_names_the_field_when_bad():
    digest, gpt = evaluation_digest, GPT_SECTION
    plain = digest({})
    for same in ("5GB", "5gb", " 5 GB", 5_000_000_000, "5000MB"):
        assert digest({"export_max_shard_size": same}) == plain, same
    small = digest({"export_max_shard_size": "500MB"})
    assert small != plain
    assert digest({"export_max_shard_size": 500_000_000}) == small  # one spelling: bytes
    assert digest({"export_max_shard_size": "5GB"}, gpt) == digest({}, gpt)
    with pytest.raises(recipes.RecipeError, match="only for model.architecture llama"):
        digest({"export_max_shard_size": "1MB"}, gpt)
    for bad in ("5GiB", "lots", 0, -1, 1.5, True):
        with pytest.raises(recipes.RecipeError, match="export_max_shard_size"):
            digest({"export_max_shard_size": bad})


def test_the_export_record_hashes_every_shard(tmp_path):
    _write_export(tmp_path / "many", max_shard_size=6000)
    directory = tmp_path / "many"
    record = json.loads((directory / export.MODEL_FILE).read_text())
    for entry in record["files"]:
        data = (directory / entry["file"]).read_bytes()
        assert entry["sha256"] == hashlib.sha256(data).hexdigest()
        assert entry["size"] == len(data)
