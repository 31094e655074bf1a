"""A pinned HF base model as a recipe input (``model.base``): prepare, init, digests, refusals.

The base model is made here: random tensors under HF's PyTorch names and layouts written with
``safetensors`` directly (``test_llama.hf_tensors``, not our writer), a hand-written
``config.json``, a byte-level BPE ``tokenizer.json`` trained here, and a
``tokenizer_config.json`` with a ChatML template. The step-0 parameters are compared with the
safetensors file read back independently (``safetensors.numpy.load_file``, transposed here).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import (
    attempts_of,
    packed_sft_recipe,
    read_events,
    run_attempt,
    update_hashes,
    write_recipe,
)
from safetensors.numpy import load_file, save_file
from test_chat_template import CHATML, make_tokenizer
from test_llama import LLAMA, hf_tensors

from minifield import cli
from minifield import recipe as recipes
from minifield.hf import pinned_base
from minifield.inputs import examples, pinned
from minifield.pipeline import preparation
from minifield.state import export
from minifield.strategies.packed_sft import demo_data

BASE = {**LLAMA, "vocab_size": 340, "rope_theta": 50000.0, "max_position_embeddings": 128}
TOKENIZER_CONFIG = {
    "eos_token": "<|im_end|>",
    "pad_token": "<|endoftext|>",
    "bos_token": None,
    "chat_template": CHATML,
}
BASE_FILES = {
    "base-config": "config.json",
    "base-weights": "model.safetensors",
    "base-tokenizer": "tokenizer.json",
    "base-tokenizer-config": "tokenizer_config.json",
}
#: HF name -> (internal path, transposed) for the checks against the file
HF_TO_OURS = {
    "model.embed_tokens.weight": ("embed/tokens", False),
    "model.norm.weight": ("final_norm/scale", False),
    "lm_head.weight": ("head/w", True),
}
for _i in range(BASE["num_hidden_layers"]):
    for _hf, _ours, _t in [
        ("input_layernorm.weight", "attn_norm/scale", False),
        ("post_attention_layernorm.weight", "mlp_norm/scale", False),
        ("self_attn.q_proj.weight", "attn/wq", True),
        ("self_attn.k_proj.weight", "attn/wk", True),
        ("self_attn.v_proj.weight", "attn/wv", True),
        ("self_attn.o_proj.weight", "attn/wo", True),
        ("mlp.gate_proj.weight", "mlp/w_gate", True),
        ("mlp.up_proj.weight", "mlp/w_up", True),
        ("mlp.down_proj.weight", "mlp/w_down", True),
    ]:
        HF_TO_OURS[f"model.layers.{_i}.{_hf}"] = (f"blocks/{_i:02d}/{_ours}", _t)


def make_base_model(directory: Path, hf: dict = BASE, tokenizer_config=TOKENIZER_CONFIG) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    save_file(hf_tensors(hf, seed=7), str(directory / "model.safetensors"), {"format": "pt"})
    (directory / "config.json").write_text(json.dumps(hf))
    make_tokenizer(directory / "tokenizer.json")
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return directory


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def make_inputs(root: Path) -> dict:
    """Chat rows (every other one without a system message) under ``root/sft`` and a base
    model under ``root/base``."""
    data = root / "sft"
    data.mkdir(parents=True, exist_ok=True)
    for split, rows in demo_data.demo_examples(
        seed=5, sizes={"train": 40, "dev": 8, "test": 8}
    ).items():
        lines = []
        for n, row in enumerate(rows):
            messages = [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": f"reverse: {row.prompt}"},
                {"role": "assistant", "content": row.response},
            ]
            lines.append({"messages": messages[1:] if n % 2 else messages})
        (data / f"{split}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    make_base_model(root / "base")
    return base_recipe(root)


def base_recipe(root: Path, model: dict | None = None) -> dict:
    pins = {s: _sha(root / "sft" / f"{s}.jsonl") for s in ("train", "dev", "test")}
    recipe = packed_sft_recipe(
        pins,
        "base-test",
        product={"name": "p", "version": "0"},
        model={
            "base": {
                "config": "base-config",
                "weights": ["base-weights"],
                "tokenizer": "base-tokenizer",
                "tokenizer_config": "base-tokenizer-config",
            },
            **(model or {}),
        },
        training={"seq_len": 64, "batch_size": 4, "warmup_steps": 1, "learning_rate": 0.003},
        limits={"max_steps": 4},
        checkpoint={"every_steps": 2, "keep": 2},
        evaluation={"eval_every": 0, "batch_size": 8, "max_generate_examples": 4},
    )
    recipe["inputs"] += [
        {"name": name, "path": f"base/{file}", "sha256": _sha(root / "base" / file)}
        for name, file in BASE_FILES.items()
    ]
    return recipe


def _prepare(recipe: dict, root: Path):
    loaded = recipes.validate(recipe)
    return loaded, loaded.strategy.prepare(loaded.data, pinned.files_by_name(loaded.data, root))


@pytest.fixture
def root(tmp_path) -> Path:
    make_inputs(tmp_path / "in")
    return tmp_path / "in"


def _get(tree, path):
    for part in path.split("/"):
        tree = tree[part]
    return np.asarray(tree)


def test_training_starts_from_the_base_weights_read_from_the_file(root, tmp_path):
    recipe = base_recipe(root)
    path = write_recipe(tmp_path / "recipe.json", recipe)
    # the real prepare stage, to disk, and the program built from what it wrote
    preparation.prepare(path, root, tmp_path / "examples")
    loaded = recipes.load(path)
    arrays, _ = examples.load(tmp_path / "examples", loaded.examples_digest)
    program = loaded.strategy.build(loaded.data, arrays)
    state = program.init_state()
    on_disk = load_file(str(root / "base" / "model.safetensors"))
    assert set(on_disk) == set(HF_TO_OURS)
    for name, (ours, transposed) in HF_TO_OURS.items():
        expected = on_disk[name].T if transposed else on_disk[name]
        np.testing.assert_array_equal(_get(state["params"], ours), expected, err_msg=name)
    # the model is what config.json says, not the schema's small defaults
    cfg = program.cfg
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.d_ff, cfg.vocab_size) == (
        32, 2, 4, 2, 48, 340,
    )  # fmt: skip
    assert cfg.rope_theta == 50000.0 and cfg.norm_eps == 1e-5 and not cfg.tie_embeddings
    # each state is its own copy: a training step donates (deletes) its state's buffers, and
    # the base weights the program starts from must survive that
    for leaf in jax.tree_util.tree_leaves(state):
        leaf.delete()
    again = program.init_state()
    for name, (ours, transposed) in HF_TO_OURS.items():
        expected = on_disk[name].T if transposed else on_disk[name]
        np.testing.assert_array_equal(_get(again["params"], ours), expected, err_msg=name)


def test_examples_are_rendered_with_the_base_models_chat_template(root):
    from tokenizers import Tokenizer

    _, (arrays, meta) = _prepare(base_recipe(root), root)
    backend = Tokenizer.from_file(str(root / "base" / "tokenizer.json"))
    # the first DEV prompt, as ChatML writes it by hand, and its expected answer
    first = json.loads((root / "sft" / "dev.jsonl").read_text().splitlines()[0])["messages"]
    prompt = (
        "<|im_start|>system\nbe brief<|im_end|>\n"
        f"<|im_start|>user\n{first[1]['content']}<|im_end|>\n<|im_start|>assistant\n"
    )
    n = int(arrays["dev_prompt_len"][0])
    assert backend.decode(arrays["dev_prompts"][0, :n].tolist(), skip_special_tokens=False) == (
        prompt
    )
    m = int(arrays["dev_answer_len"][0])
    answer = backend.decode(arrays["dev_answers"][0, :m].tolist(), skip_special_tokens=False)
    assert answer == first[2]["content"] + "<|im_end|>"
    # the loss covers exactly the answers' tokens (content + <|im_end|>) in the packed rows
    assert meta["tokenizer"]["special_tokens"]["eos"] == "<|im_end|>"
    expected = sorted(_chatml_by_hand(root / "sft" / "train.jsonl"))
    assert _packed_prompts_and_trained_text(arrays, "train", backend) == expected


def _chatml_by_hand(path: Path) -> list[tuple[str, str]]:
    """(prompt, answer) of each row of a supervised file, in ChatML written out here: the
    template's default system message where a row has none, the answer + ``<|im_end|>``."""
    out = []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        contents = [m["content"] for m in row["messages"]]
        if len(contents) == 3:
            system, user, answer = contents
        else:
            system, (user, answer) = "You are a helpful assistant.", contents
        prompt = (
            f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n"
            "<|im_start|>assistant\n"
        )
        out.append((prompt, answer + "<|im_end|>"))
    return out


def _packed_prompts_and_trained_text(arrays, split: str, backend) -> list[tuple[str, str]]:
    """Each packed example's untrained slots and trained slots, decoded; the trained ones
    must be one run at the example's end."""
    tokens, segments = arrays[f"{split}_tokens"], arrays[f"{split}_segments"]
    mask = arrays[f"{split}_loss_mask"]
    assert set(np.unique(mask)) <= {0.0, 1.0} and not mask[segments == 0].any()
    out = []
    for row in range(tokens.shape[0]):
        for segment in sorted(set(segments[row].tolist()) - {0}):
            (slots,) = np.nonzero(segments[row] == segment)
            trained = mask[row, slots] == 1.0
            first = int(np.argmax(trained))
            assert trained.any() and trained[first:].all() and not trained[:first].any()
            ids = tokens[row, slots].tolist()
            out.append(
                tuple(
                    backend.decode(part, skip_special_tokens=False)
                    for part in (ids[:first], ids[first:])
                )
            )
    return sorted(out)


def test_a_different_base_file_is_a_different_computation(root):
    first = recipes.validate(base_recipe(root))
    tokenizer_config = {**TOKENIZER_CONFIG, "chat_template": CHATML.replace("helpful", "kind")}
    (root / "base" / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    second = recipes.validate(base_recipe(root))
    assert first.computation_digest != second.computation_digest
    assert first.examples_digest != second.examples_digest
    weights = root / "base" / "model.safetensors"
    tensors = load_file(str(weights))
    tensors["model.norm.weight"][0] += 1.0
    save_file(tensors, str(weights), {"format": "pt"})
    assert recipes.validate(base_recipe(root)).computation_digest not in (
        first.computation_digest,
        second.computation_digest,
    )
    # and the recipe's template override is part of both digests too
    third = recipes.validate(base_recipe(root, {"chat_template": CHATML}))
    assert third.computation_digest != second.computation_digest
    assert third.examples_digest != second.examples_digest


def test_recipe_keys_must_agree_with_config_json(root):
    _, (arrays, _) = _prepare(base_recipe(root, {"d_model": 32, "n_kv_heads": 2}), root)
    assert "base.embed.tokens" in arrays
    with pytest.raises(pinned_base.BaseModelError, match=r"config.json: hidden_size gives d_model"):
        _prepare(base_recipe(root, {"d_model": 64}), root)
    with pytest.raises(pinned_base.BaseModelError, match=r"config.json: rope_theta gives"):
        _prepare(base_recipe(root, {"rope_theta": 10000}), root)


def test_recipe_section_refusals_with_a_base_model(root):
    for model, where in [
        ({"architecture": "gpt"}, "/model/architecture"),
        ({"tokenizer": {"kind": "tokenizers-json"}}, "/model/tokenizer"),
        ({"positions": "learned"}, "/model/positions"),
        ({"d_model": 30, "n_heads": 4}, "/model/n_heads"),
    ]:
        with pytest.raises(recipes.RecipeError) as info:
            recipes.validate(base_recipe(root, model))
        assert where in str(info.value)
    recipe = base_recipe(root)
    recipe["inputs"] = [i for i in recipe["inputs"] if i["name"] != "base-tokenizer"]
    with pytest.raises(recipes.RecipeError, match="base-tokenizer"):
        recipes.validate(recipe)
    # a template override without a base model has nothing to render for
    recipe = base_recipe(root, {"chat_template": "x"})
    del recipe["model"]["base"]
    recipe["inputs"] = recipe["inputs"][:3]
    with pytest.raises(recipes.RecipeError, match="/model/chat_template"):
        recipes.validate(recipe)


def _replace(root: Path, file: str, write) -> dict:
    write(root / "base" / file)
    return base_recipe(root)


@pytest.mark.parametrize(
    ("file", "change", "message"),
    [
        ("config.json", {"hidden_size": 64}, "model.safetensors: tensor .* has shape"),
        ("config.json", {"num_hidden_layers": 3}, "tensor model.layers.2.* missing"),
        ("config.json", {"num_hidden_layers": 1}, "unexpected tensor model.layers.1"),
        ("config.json", {"tie_word_embeddings": True}, "lm_head.weight differs from model.embed"),
        ("config.json", {"architectures": ["GPT2LMHeadModel"]}, "config.json: architectures"),
        ("config.json", {"vocab_size": 100}, "tokenizer.json: the tokenizer has ids up to"),
        ("tokenizer_config.json", {"chat_template": "{% for %}"}, "does not compile"),
        ("tokenizer_config.json", {"chat_template": None}, "no chat_template"),
        ("tokenizer_config.json", {"eos_token": "<nope>"}, "eos_token='<nope>' is not in"),
    ],
)
def test_bad_base_models_are_refused_naming_the_file(root, file, change, message):
    def write(path):
        original = BASE if file == "config.json" else TOKENIZER_CONFIG
        path.write_text(json.dumps({**original, **change}))

    recipe = _replace(root, file, write)
    if change.get("vocab_size") == 100:
        # a smaller embedding to go with the smaller vocab_size, so only the tokenizer is wrong
        save_file(
            hf_tensors({**BASE, "vocab_size": 100}, seed=7),
            str(root / "base" / "model.safetensors"),
        )
        recipe = base_recipe(root)
    with pytest.raises(pinned_base.BaseModelError, match=message) as info:
        _prepare(recipe, root)
    assert str(root / "base") in str(info.value)


def test_a_failing_chat_template_names_the_data_file(root):
    template = "{{ raise_exception('no system messages') if messages[0]['role'] == 'system' }}"
    with pytest.raises(pinned_base.BaseModelError, match=r"train.jsonl:1: .*no system"):
        _prepare(base_recipe(root, {"chat_template": template}), root)


def test_pickle_weights_are_refused_unread(root):
    (root / "base" / "pytorch_model.bin").write_bytes(b"\x80\x04 not really a pickle")
    recipe = base_recipe(root)
    recipe["inputs"][4] = {
        "name": "base-weights",
        "path": "base/pytorch_model.bin",
        "sha256": _sha(root / "base" / "pytorch_model.bin"),
    }
    with pytest.raises(pinned_base.BaseModelError, match="pytorch_model.bin: pickle checkpoints"):
        _prepare(recipe, root)


def _sharded(root: Path, drop_shard: bool = False) -> dict:
    tensors = load_file(str(root / "base" / "model.safetensors"))
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2]}
    halves["model-00002-of-00002.safetensors"] = names[1::2]
    shard_dir = root / "sharded"
    shard_dir.mkdir()
    weight_map = {}
    for file, part in halves.items():
        save_file({n: tensors[n] for n in part}, str(shard_dir / file), {"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    (shard_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    recipe = base_recipe(root)
    recipe["inputs"] = [i for i in recipe["inputs"] if i["name"] != "base-weights"]
    shards = list(halves)[:1] if drop_shard else list(halves)
    for n, file in enumerate([*shards, "model.safetensors.index.json"]):
        name = "base-index" if file.endswith(".json") else f"base-shard-{n}"
        path = shard_dir / file
        recipe["inputs"].append({"name": name, "path": f"sharded/{file}", "sha256": _sha(path)})
    recipe["model"]["base"]["weights"] = [f"base-shard-{n}" for n in range(len(shards))]
    recipe["model"]["base"]["index"] = "base-index"
    return recipe


def test_a_sharded_base_model_loads_like_the_single_file(root):
    _, (single, _) = _prepare(base_recipe(root), root)
    _, (sharded, _) = _prepare(_sharded(root), root)
    params = [k for k in single if k.startswith("base.")]
    assert params and params == [k for k in sharded if k.startswith("base.")]
    for key in params:
        np.testing.assert_array_equal(single[key], sharded[key])


def test_remote_base_files_are_found_by_input_name_as_fetch_places_them(root):
    """A remote input lives at its name under the input root (where fetch_inputs puts it), so
    remote shards are named as the index names them."""
    _, (single, _) = _prepare(base_recipe(root), root)
    recipe = _sharded(root)
    renamed = {"base-shard-0": "model-00001-of-00002.safetensors"}
    renamed["base-shard-1"] = "model-00002-of-00002.safetensors"
    for item in recipe["inputs"]:
        if item["name"].startswith("base"):
            source = root / item.pop("path")
            item["name"] = renamed.get(item["name"], item["name"])
            item["url"] = f"https://models.example/{source.name}"
            item["size"] = source.stat().st_size
            shutil.copyfile(source, root / item["name"])  # what fetch_inputs places
    base = recipe["model"]["base"]
    base["weights"] = [renamed[n] for n in base["weights"]]
    _, (remote, _) = _prepare(recipe, root)
    for key in [k for k in single if k.startswith("base.")]:
        np.testing.assert_array_equal(single[key], remote[key])


def test_an_index_naming_a_missing_shard_is_refused(root):
    with pytest.raises(pinned_base.BaseModelError, match="names missing shard model-00002"):
        _prepare(_sharded(root, drop_shard=True), root)


# -- through the worker (slow) ------------------------------------------------------------------


def _run(tmp_path, path, root, out, *extra, codes=(0,)):
    run_attempt(path, root, tmp_path / out, *extra, codes=codes)
    return attempts_of(tmp_path / out, "base-test")


@pytest.mark.slow
def test_a_base_model_recipe_trains_and_resumes_bit_identically_in_the_worker(root, tmp_path):
    recipe = base_recipe(root)
    # what is checked is the updates and their state hashes: no greedy decoding in the final
    # evaluations (each worker would compile the generation loop for nothing checked here)
    recipe["evaluation"]["max_generate_examples"] = 0
    path = write_recipe(tmp_path / "recipe.json", recipe)
    (attempt,) = _run(tmp_path, path, root, "out")
    result = json.loads((attempt / "result.json").read_text())
    assert result["status"] == "completed" and result["steps_completed"] == 4
    events = read_events(attempt / "events.jsonl")
    assert [e["step"] for e in events if e["type"] == "update"] == [1, 2, 3, 4]
    assert all(np.isfinite(e["loss"]) for e in events if e["type"] == "update")
    # a crash after update 3, resumed from the step-2 checkpoint: the same states bit for bit
    (crashed,) = _run(tmp_path, path, root, "crash", "--fail-after-step", "3", codes=(1,))
    (_, resumed) = _run(tmp_path, path, root, "crash", "--resume-from", crashed)
    assert update_hashes([crashed, resumed]) == update_hashes([attempt])
    final = json.loads((resumed / "result.json").read_text())["final_state_hash"]
    assert final == result["final_state_hash"]


@pytest.mark.slow
def test_a_bad_base_model_ends_the_worker_with_exit_2_and_nothing_trained(root, tmp_path):
    bad = {**BASE, "intermediate_size": 40}  # the file's MLP tensors are 48 wide
    (root / "base" / "config.json").write_text(json.dumps(bad))
    path = write_recipe(tmp_path / "recipe.json", base_recipe(root))
    (attempt,) = _run(tmp_path, path, root, "out", codes=(2,))
    result = json.loads((attempt / "result.json").read_text())
    # exit 2 (checked by _run): invalid inputs; the attempt's status is "failed" in the examples
    # phase, the error naming the pinned file, the tensor and config.json
    assert result["status"] == "failed" and result["steps_completed"] == 0
    assert result["error"]["phase"] == "examples"
    assert result["error"]["message"] == (
        f"{root / 'base' / 'model.safetensors'}: tensor model.layers.0.mlp.gate_proj.weight has "
        "shape [48, 32], config.json implies [40, 32] (intermediate_size, hidden_size)"
    )
    assert not [e for e in read_events(attempt / "events.jsonl") if e["type"] == "update"]
    assert result["checkpoint"] is None and result["final_state_hash"] is None


# 25-40 s of compiling on this machine: in the slow tier, so the fast tier stays a quick loop
@pytest.mark.slow
def test_a_base_model_runs_export_is_an_hf_directory_with_its_tokenizer_and_template(
    root, tmp_path
):
    """The export carries the base model's own tokenizer files byte for byte and its eos/bos
    ids; it loads back (ExportedModel, the store's gate, ``minifield generate``) and prompts
    are the chat template's generation prompt, as transformers renders it."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from minifield.models.model import greedy_generate
    from minifield.strategies.lm.export_format import ExportedModel

    recipe = base_recipe(root)
    loaded, (arrays, _) = _prepare(recipe, root)
    program = loaded.strategy.build(loaded.data, arrays)
    state = program.init_state()
    directory = tmp_path / "export"
    program.export(state, directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (directory / name).read_bytes() == (root / "base" / name).read_bytes(), name
    backend = Tokenizer.from_file(str(root / "base" / "tokenizer.json"))
    generation = json.loads((directory / "generation_config.json").read_text())
    assert generation["eos_token_id"] == backend.token_to_id("<|im_end|>")
    assert generation["pad_token_id"] == backend.token_to_id("<|endoftext|>")
    assert generation["bos_token_id"] is None  # the base model has no bos_token

    exported = ExportedModel(directory)
    # the test's tokenizer_config.json names no tokenizer_class (AutoTokenizer would pick
    # Llama's, which needs a bos_token); the fast tokenizer reads the files as they are
    reference = PreTrainedTokenizerFast.from_pretrained(str(directory))
    conversation = [{"role": "user", "content": "reverse: abc"}]
    expected = reference.apply_chat_template(
        conversation, tokenize=True, add_generation_prompt=True
    )
    assert exported.prompt_ids("reverse: abc") == list(expected)
    # the gate re-evaluates the export alone to the figures the run measured (FP32 export)
    measured = program.evaluate(state)
    gate = loaded.strategy.evaluate_export(loaded.data, directory)
    assert gate["dev_exact_match"] == measured["dev_exact_match"]
    np.testing.assert_allclose(gate["dev_loss"], measured["dev_loss"], rtol=1e-5)
    # minifield generate (its command, in process): greedy tokens from the generation prompt,
    # decoded without special tokens
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(
            ["generate", "--model", str(directory), "--prompt", "reverse: abc"]
            + ["--max-new-tokens", "6"]
        )
    assert code == 0
    new = greedy_generate(
        exported.params, exported.cfg, list(expected), 6, generation["eos_token_id"]
    )
    text = reference.decode(new, skip_special_tokens=True)
    assert out.getvalue() == text + "\n"


def test_a_damaged_base_model_export_is_refused_naming_the_file(root, tmp_path):
    from minifield.strategies.lm.export_format import ExportedModel

    loaded, (arrays, _) = _prepare(base_recipe(root), root)
    program = loaded.strategy.build(loaded.data, arrays)
    directory = tmp_path / "export"
    program.export(program.init_state(), directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    # the listed sha256 no longer matches: export.read refuses before any parsing
    with pytest.raises(export.ExportError, match="tokenizer_config.json"):
        ExportedModel(directory)


def test_a_scanned_run_holds_the_base_weights_stacked_and_exports_them_per_layer(root, tmp_path):
    """``model.scan_layers``: the state holds the blocks stacked along a layer axis (each
    layer's slice is the file's tensor), and the export writes them back per layer, equal to
    the base file byte for byte (FP32, nothing trained)."""
    loaded, (arrays, _) = _prepare(base_recipe(root, {"scan_layers": True}), root)
    program = loaded.strategy.build(loaded.data, arrays)
    state = program.init_state()
    assert set(state["params"]["blocks"]) == {"stacked"}
    on_disk = load_file(str(root / "base" / "model.safetensors"))
    for name, (ours, transposed) in HF_TO_OURS.items():
        expected = on_disk[name].T if transposed else on_disk[name]
        if ours.startswith("blocks/"):
            _, layer, rest = ours.split("/", 2)
            held = _get(state["params"], f"blocks/stacked/{rest}")[int(layer)]
        else:
            held = _get(state["params"], ours)
        np.testing.assert_array_equal(held, expected, err_msg=name)
    program.export(state, tmp_path / "export")
    exported = load_file(str(tmp_path / "export" / "model.safetensors"))
    assert set(exported) == set(on_disk)
    for name, tensor in on_disk.items():
        np.testing.assert_array_equal(exported[name], tensor, err_msg=name)
