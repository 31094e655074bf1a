"""HF export of ``model.architecture: llama`` runs: the directory transformers loads.

References: transformers' ``FlaxLlamaForCausalLM`` loading the export with
``from_pretrained(dir, from_pt=True)`` (logits and greedy tokens); hashlib for the file list of
``model.json``; bfloat16 rounding written out here in integer numpy (round to nearest, ties to
even, on the FP32 bit pattern); the byte tokenizer's definition (id = UTF-8 byte).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import subprocess
from pathlib import Path

import jax
import numpy as np
import pytest
import test_llama
from conftest import run_generate, train_as_the_pipeline, write_recipe
from test_llama import _flax_model, _recipe

from minifield import cli
from minifield import recipe as recipes
from minifield.data import encoding
from minifield.data import tokenizer as tokenizers
from minifield.hf import checkpoint as hf_checkpoint
from minifield.hf import directory as hf_directory
from minifield.models import llama, model
from minifield.state import export
from minifield.strategies.lm.export_format import ExportedModel
from minifield.strategies.packed_sft import demo_data

flax_rope_theta = test_llama.flax_rope_theta  # the fixture (transformers' rope_theta gap)

HF_FILES = {
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "dev.jsonl",
    "model.json",
}


#: the tiny Llama these tests export
TINY_LLAMA = {
    "vocab_size": tokenizers.BYTE_VOCAB_SIZE,
    "d_model": 32,
    "n_layers": 2,
    "n_heads": 4,
    "n_kv_heads": 2,
    "d_ff": 48,
    "max_len": 48,
    "rope_theta": 50000.0,
}


def tiny_llama(compute_dtype="float32", seed=0, **changes):
    cfg = llama.LlamaConfig(**{**TINY_LLAMA, "compute_dtype": compute_dtype, **changes})
    params = llama.init_params(cfg, jax.random.key(seed))
    # larger than the initialisation, so the logits are far from uniform
    return cfg, jax.tree_util.tree_map(lambda x: np.asarray(x * 3.0), params)


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """FP32 -> bfloat16 bit patterns, round to nearest with ties to even (finite inputs)."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


# -- fast tier ----------------------------------------------------------------------------------


def test_bfloat16_and_float16_exports_hold_the_rounded_fp32_values(tmp_path):
    from safetensors import safe_open

    cfg, params = tiny_llama(qkv_bias=True, tie_embeddings=True)
    wq = np.asarray(params["blocks"]["01"]["attn"]["wq"])
    for dtype, stored in (("bfloat16", "BF16"), ("float16", "F16")):
        hf_checkpoint.write(tmp_path / dtype, cfg, params, dtype)
        assert json.loads((tmp_path / dtype / "config.json").read_text())["torch_dtype"] == dtype
        with safe_open(tmp_path / dtype / "model.safetensors", framework="numpy") as f:
            assert {f.get_slice(k).get_dtype() for k in f.keys()} == {stored}
            raw = f.get_tensor("model.layers.1.self_attn.q_proj.weight")
        if dtype == "bfloat16":
            np.testing.assert_array_equal(raw.view(np.uint16), bf16_bits(wq.T))
            expected = (bf16_bits(wq).astype(np.uint32) << 16).view(np.float32)
        else:
            np.testing.assert_array_equal(raw, wq.T.astype(np.float16))
            expected = wq.astype(np.float16).astype(np.float32)
        assert not np.array_equal(expected, wq)  # the rounding is visible
        _, loaded = hf_checkpoint.load(tmp_path / dtype, compute_dtype="float32")
        np.testing.assert_array_equal(np.asarray(loaded["blocks"]["01"]["attn"]["wq"]), expected)


def test_built_in_byte_tokenizer_is_exported_as_an_equivalent_tokenizer_json():
    from tokenizers import Tokenizer

    backend = Tokenizer.from_str(hf_directory.byte_tokenizer_json().decode())
    for text in ["hello world", "  two  spaces\nnew line\t", "héllo → 東京 🙂", "<x>", ""]:
        assert backend.encode(text, add_special_tokens=False).ids == list(text.encode("utf-8"))
        assert backend.decode(list(text.encode("utf-8"))) == text
    assert backend.get_vocab_size(with_added_tokens=True) == 260
    ids = backend.encode("a<eos>b<pad><bos><sep>", add_special_tokens=False).ids
    assert ids == [97, 258, 98, 256, 257, 259]


LLAMA_SECTION = {"architecture": "llama", "d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64}
GPT_SECTION = {"d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64}


def evaluation_digest(evaluation: dict, model_section=LLAMA_SECTION) -> str:
    """The computation digest of a tiny recipe with this ``evaluation`` section."""
    recipe = _recipe(dict(model_section))
    recipe["evaluation"] = evaluation
    return recipes.validate(recipe).computation_digest


def test_export_dtype_keeps_old_digests_and_is_part_of_new_ones():
    digest, gpt = evaluation_digest, GPT_SECTION
    plain = digest({})
    assert digest({"export_dtype": "float32"}) == plain
    narrowed = {dtype: digest({"export_dtype": dtype}) for dtype in ("bfloat16", "float16")}
    assert len({plain, *narrowed.values()}) == 3  # each export dtype its own computation
    assert digest({"export_dtype": "float32"}, gpt) == digest({}, gpt)
    with pytest.raises(recipes.RecipeError, match="only for model.architecture llama"):
        digest({"export_dtype": "bfloat16"}, gpt)
    with pytest.raises(recipes.RecipeError, match="export_dtype"):
        digest({"export_dtype": "int8"})


def write_packed_sft_export(
    directory: Path, cfg, params, export_dtype="float32", max_shard_size=None
) -> dict:
    """``params`` as a packed-sft HF export (byte tokenizer, a one-example DEV split) stored
    as ``export_dtype``; its ``model.json`` config."""
    tokenizer = tokenizers.byte_tokenizer()
    dev = b'{"prompt": "a", "response": "b"}\n'
    config = {
        "strategy": {"name": "packed-sft", "version": "12.0.0"},
        "model": cfg.to_dict(),
        "tokenizer": tokenizer.config(),
        "dev": {"file": "dev.jsonl", "sha256": hashlib.sha256(dev).hexdigest()},
    }
    hf_directory.write(
        directory, cfg, params, tokenizer, None, {"dev.jsonl": dev}, config, export_dtype,
        max_shard_size=max_shard_size,
    )  # fmt: skip
    return config


def _write_export(directory: Path, dtype="float32", max_shard_size=None):
    cfg, params = tiny_llama()
    write_packed_sft_export(directory, cfg, params, dtype, max_shard_size)
    return cfg, params


def test_export_directory_lists_every_file_with_its_sha256_and_loads_back(tmp_path):
    cfg, params = _write_export(tmp_path / "export")
    directory = tmp_path / "export"
    assert {p.name for p in directory.iterdir()} == HF_FILES
    listed = json.loads((directory / "model.json").read_text())
    assert listed["format"] == export.FILES_FORMAT
    assert {f["file"]: f["sha256"] for f in listed["files"]} == {
        name: hashlib.sha256((directory / name).read_bytes()).hexdigest()
        for name in HF_FILES - {"model.json"}
    }
    generation = json.loads((directory / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (257, 258)
    assert (generation["pad_token_id"], generation["max_length"]) == (256, 48)
    special = json.loads((directory / "tokenizer_config.json").read_text())
    # the byte tokenizer's four special tokens after the 256 bytes (its definition)
    names = {"pad": 256, "bos": 257, "eos": 258, "sep": 259}
    assert {k: special[f"{k}_token"] for k in names} == {k: f"<{k}>" for k in names}
    assert special["added_tokens_decoder"] == {
        str(i): {"content": f"<{k}>", "special": True, "lstrip": False, "rstrip": False,
                 "normalized": False, "single_word": False}
        for k, i in names.items()
    }  # fmt: skip
    assert (special["add_bos_token"], special["add_eos_token"]) == (False, False)

    exported = ExportedModel(directory)
    assert exported.cfg == cfg
    for name, value in jax.tree_util.tree_leaves_with_path(params):
        got = exported.params
        for key in name:
            got = got[key.key]
        np.testing.assert_array_equal(np.asarray(got), value)

    # a changed byte in any listed file is caught before anything is loaded
    weights = directory / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + b"\x01")
    with pytest.raises(export.ExportError, match=r"model.safetensors: sha256 mismatch"):
        ExportedModel(directory)


def test_a_tokenizers_json_run_exports_its_file_and_its_special_tokens(tmp_path):
    from test_tokenizer import _write_bpe
    from tokenizers import Tokenizer

    source = _write_bpe(tmp_path / "source.json")
    tokenizer = tokenizers.from_file(source, {"sep": "<unk>"})
    cfg, params = tiny_llama(vocab_size=tokenizer.vocab_size)
    config = {
        "strategy": {"name": "packed-sft", "version": "12.0.0"},
        "model": cfg.to_dict(),
        "tokenizer": tokenizer.config("tokenizer.json"),
    }
    directory = tmp_path / "export"
    hf_directory.write(
        directory, cfg, params, tokenizer, source.read_bytes(), {}, config, "float32"
    )
    assert (directory / "tokenizer.json").read_bytes() == source.read_bytes()
    backend = Tokenizer.from_file(str(source))
    special = json.loads((directory / "tokenizer_config.json").read_text())
    assert (special["sep_token"], special["eos_token"]) == ("<unk>", "<eos>")
    assert special["added_tokens_decoder"][str(backend.token_to_id("<unk>"))]["content"] == "<unk>"
    generation = json.loads((directory / "generation_config.json").read_text())
    assert generation["eos_token_id"] == backend.token_to_id("<eos>")
    assert generation["bos_token_id"] == backend.token_to_id("<bos>")
    assert generation["pad_token_id"] == backend.token_to_id("<pad>")
    assert ExportedModel(directory).tokenizer.sep_id == backend.token_to_id("<unk>")


def test_config_json_disagreeing_with_model_json_is_refused(tmp_path):
    directory = tmp_path / "export"
    _write_export(directory)
    hf = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**hf, "rope_theta": 10000.0}))
    export.write_files(directory, json.loads((directory / "model.json").read_text())["config"])
    with pytest.raises(export.ExportError, match=r"config.json: describes .* records"):
        ExportedModel(directory)


# -- slow tier: a real worker run, transformers, generate, the store ----------------------------


def _llama_run(root: Path) -> dict:
    """validate → prepare → real worker → evaluate → recovery proof, as the pipeline does."""
    data = root / "in" / "sft"
    data.mkdir(parents=True)
    pins = {}
    sizes = {"train": 48, "dev": 8, "test": 8}
    for split, rows in demo_data.demo_examples(seed=5, sizes=sizes).items():
        blob = encoding.to_jsonl(rows)
        (data / f"{split}.jsonl").write_bytes(blob)
        pins[split] = hashlib.sha256(blob).hexdigest()
    recipe = _recipe(
        {
            "architecture": "llama",
            "d_model": 32,
            "n_layers": 2,
            "n_heads": 4,
            "n_kv_heads": 2,
            "d_ff": 64,
            "rope_theta": 50000.0,
            "tie_embeddings": False,
            "compute_dtype": "float32",
        }
    )
    recipe["job_id"] = "hf-export"
    recipe["inputs"] = [{**i, "sha256": pins[i["name"]]} for i in recipe["inputs"]]
    recipe["training"]["learning_rate"] = 0.01
    recipe["evaluation"] = {"eval_every": 0, "batch_size": 8, "max_generate_examples": 4}
    raw = write_recipe(root / "raw.json", recipe)
    attempt = train_as_the_pipeline(raw, root, root / "in")
    return {"root": root, "export": attempt / "export", "attempt": attempt}


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory):
    return _llama_run(tmp_path_factory.mktemp("hf-run"))


@pytest.mark.slow
def test_worker_export_loads_in_transformers_with_equal_logits_and_tokens(
    llama_run, flax_rope_theta
):
    directory = llama_run["export"]
    assert {p.name for p in directory.iterdir()} == HF_FILES
    hf = json.loads((directory / "config.json").read_text())
    assert hf["architectures"] == ["LlamaForCausalLM"] and hf["torch_dtype"] == "float32"
    # transformers' tokenizer from the export encodes as the run did (id = UTF-8 byte)
    from transformers import AutoTokenizer

    hf_tokenizer = AutoTokenizer.from_pretrained(str(directory))
    assert (hf_tokenizer.bos_token_id, hf_tokenizer.eos_token_id) == (257, 258)
    assert (hf_tokenizer.pad_token_id, hf_tokenizer.sep_token_id) == (256, 259)
    text = "<bos>héllo wörld<sep>"
    assert hf_tokenizer(text, add_special_tokens=False).input_ids == [
        257,
        *"héllo wörld".encode(),
        259,
    ]

    flax_rope_theta(hf["rope_theta"])
    reference = _flax_model(directory, hf)
    cfg, params = hf_checkpoint.load(directory, compute_dtype="float32")
    dev = [
        encoding.encode(encoding.Example(row["prompt"], "x"), tokenizers.byte_tokenizer()).prompt
        for row in map(json.loads, (directory / "dev.jsonl").read_text().splitlines())
    ]
    # two DEV prompts of one length (the first and the next as long): each jitted forward and
    # generate program (theirs and ours) is compiled once, not once per prompt length
    prompts = [dev[0], next(p for p in dev[1:] if len(p) == len(dev[0]))]
    assert prompts[0] != prompts[1]
    for prompt in prompts:
        ids = np.asarray([prompt], np.int32)
        theirs = np.asarray(reference(ids).logits)[0]
        tokens = jax.numpy.asarray(ids)
        # jitted (test_llama.forward): op by op, every primitive would be compiled afresh
        ours = test_llama.forward(
            params, cfg, tokens, jax.numpy.ones_like(tokens), jax.numpy.arange(len(prompt))[None]
        )
        np.testing.assert_allclose(np.asarray(ours)[0], theirs, atol=1e-4)
        # transformers takes eos/pad from the export's generation_config.json: it stops at
        # <eos> (258) and pads the rest with <pad> (256)
        generated = reference.generate(ids, max_new_tokens=8, do_sample=False)
        theirs = np.asarray(generated.sequences)[0, len(prompt) :].tolist()
        ours = model.greedy_generate(params, cfg, prompt, 8, 258)
        assert theirs[: len(ours)] == ours
        if len(ours) < 8:
            assert theirs[len(ours)] == 258 and set(theirs[len(ours) + 1 :]) <= {256}


@pytest.mark.slow
def test_minifield_generate_runs_on_the_export(llama_run):
    directory = llama_run["export"]
    prompt = json.loads((directory / "dev.jsonl").read_text().splitlines()[0])["prompt"]
    proc = run_generate(directory, prompt, 12)
    assert proc.returncode == 0, proc.stderr
    # the same text as greedy decoding from the HF files alone (tokens -> bytes by hand)
    cfg, params = hf_checkpoint.load(directory, compute_dtype="float32")
    ids = [257, *prompt.encode("utf-8"), 259]
    new = model.greedy_generate(params, cfg, ids, 12, 258, cache=False)
    assert proc.stdout == bytes(i for i in new if i < 256).decode("utf-8", "replace") + "\n"


def _store(store: Path, *args) -> subprocess.CompletedProcess:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["store", "--store", str(store), *map(str, args)])
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


@pytest.mark.slow
def test_the_store_publishes_the_hf_export_and_its_gate_reevaluates_it(llama_run, tmp_path):
    root = llama_run["root"]
    store = tmp_path / "store"
    proc = _store(
        store,
        "publish",
        llama_run["export"],
        "--recipe",
        root / "recipe.json",
        "--train-result",
        root / "result.json",
        "--metrics",
        root / "metrics.json",
        "--proof",
        root / "proof.json",
    )
    assert proc.returncode == 0, proc.stderr
    content_id = proc.stdout.strip()
    artifact = store / "artifacts" / content_id
    assert HF_FILES <= {p.name for p in artifact.iterdir()}
    activated = _store(store, "activate", content_id)
    assert activated.returncode == 0, activated.stderr
    # the gate re-ran the acceptance evaluation from the published HF directory alone: the
    # run's final DEV figures (the export is the step-4 state)
    report = json.loads(activated.stdout)
    final = json.loads((root / "metrics.json").read_text())["checkpoints"][-1]
    assert final["step"] == 4
    assert report["reevaluation"]["dev_loss"] == pytest.approx(final["dev"]["dev_loss"], rel=1e-6)
    assert report["reevaluation"]["dev_exact_match"] == final["dev"]["dev_exact_match"]

    # a published weight file changed afterwards: the gate refuses
    weights = artifact / "model.safetensors"
    weights.chmod(0o644)
    weights.write_bytes(weights.read_bytes()[:-1] + b"\x01")
    refused = _store(store, "activate", content_id)
    assert refused.returncode != 0 and "model.safetensors" in refused.stderr
