"""The Llama demo: the shipped base model, its provenance, and the demo recipe through Snakemake.

Fast tier: the shipped files are the ones the recipes pin and ``provenance.json`` names, the
pretraining and fine-tuning data regenerate byte for byte, and transformers renders the
base's chat template into exactly the token ids the pipeline trains on.

Slow tier (the demo recipe's computation in the README's run, ``readme_pipeline_run``: the
default pipeline as the README's first command runs it, scheduled on the worker that builds
it): the recovery proof passed, the evaluation has DEV and TEST figures,
the export is an HF directory transformers' ``FlaxLlamaForCausalLM`` loads with logits equal
to ours, and ``minifield generate`` prints what transformers' greedy generation decodes.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import REPO, run_generate

import minifield
from minifield.data import encoding
from minifield.data import tokenizer as tokenizers
from minifield.strategies.packed_sft import demo_data

BASE = REPO / "data" / "llama-base"
DEMO_RECIPE = REPO / "config" / "recipes" / "llama-sft-demo.yaml"
BASE_RECIPE = REPO / "config" / "recipes" / "llama-base.yaml"


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _pins(recipe: Path) -> dict[str, str]:
    return {i["path"]: i["sha256"] for i in yaml.safe_load(recipe.read_text())["inputs"]}


def test_the_shipped_base_is_what_the_recipes_pin_and_the_provenance_names():
    provenance = json.loads((BASE / "provenance.json").read_text())
    shipped = {name: _sha(BASE / name) for name in provenance["files"]}
    assert shipped == provenance["files"]
    assert set(shipped) == {p.name for p in BASE.iterdir() if p.is_file()} - {"provenance.json"}
    demo = _pins(DEMO_RECIPE)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert demo[f"llama-base/{name}"] == shipped[name]
    # produced by the base recipe as it is now: same computation, same file
    assert provenance["computation_digest"] == minifield.validate(BASE_RECIPE).computation_digest
    assert provenance["recipe_sha256"] == _sha(BASE_RECIPE)
    assert _pins(BASE_RECIPE)["llama-base/tokenizer.json"] == shipped["tokenizer.json"]
    assert (BASE / "model.safetensors").stat().st_size < 1_000_000


def test_the_demo_data_regenerates_byte_for_byte(tmp_path):
    written = demo_data.write(tmp_path)
    pinned = {**_pins(BASE_RECIPE), **_pins(DEMO_RECIPE)}
    for relative, sha in written.items():
        assert pinned[relative] == sha == _sha(REPO / "data" / relative), relative
    # the fine-tuning DEV/TEST strings occur nowhere else
    words = {}
    for part in ("llama-base/pretrain", "llama-sft-demo"):
        for split in ("train", "dev", "test"):
            rows = (tmp_path / part / f"{split}.jsonl").read_text().splitlines()
            words[part, split] = {json.loads(r)["prompt"].split(": ")[1] for r in rows}
    held_out = words["llama-sft-demo", "dev"] | words["llama-sft-demo", "test"]
    others = set().union(*(w for key, w in words.items() if key[0] != "llama-sft-demo"))
    assert not held_out & (others | words["llama-sft-demo", "train"])


def test_transformers_renders_the_base_template_as_the_pipeline_layout():
    """The base's chat template through transformers' own ``apply_chat_template`` gives the
    ``<bos>prompt<sep>answer<eos>`` ids a recipe without a base model trains on."""
    from transformers import AutoTokenizer

    hf_tokenizer = AutoTokenizer.from_pretrained(str(BASE))
    row = json.loads((REPO / "data/llama-sft-demo/dev.jsonl").read_text().splitlines()[0])
    assert row["response"] == row["prompt"].split(": ")[1] + row["prompt"].split(": ")[1][::-1]
    conversation = [
        {"role": "user", "content": row["prompt"]},
        {"role": "assistant", "content": row["response"]},
    ]
    whole = hf_tokenizer.apply_chat_template(conversation, tokenize=True)
    prompt = hf_tokenizer.apply_chat_template(conversation[:1], add_generation_prompt=True)
    ours = tokenizers.from_file(BASE / "tokenizer.json")
    encoded = encoding.encode(encoding.Example(row["prompt"], row["response"]), ours)
    assert whole == encoded.tokens and prompt == encoded.prompt
    # by hand: one id per character, specials from tokenizer.json
    vocab = json.loads((BASE / "tokenizer.json").read_text())["model"]["vocab"]
    assert prompt == [vocab["<bos>"], *(vocab[c] for c in row["prompt"]), vocab["<sep>"]]


# -- slow tier: the demo recipe through the real pipeline ---------------------------------------


@pytest.fixture(scope="module")
def demo_run(readme_pipeline_run) -> Path:
    """The demo recipe's computation in the README's run (read only)."""
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    assert "config/recipes/llama-sft-demo.yaml" in config["recipes"]  # in the default pipeline
    cdigest = minifield.validate(DEMO_RECIPE).computation_digest[:16]
    return readme_pipeline_run / "results" / "computations" / cdigest


@pytest.mark.slow
def test_the_demo_passes_its_proof_and_is_evaluated_and_published(demo_run):
    proof = json.loads((demo_run / "qualification" / "proof.json").read_text())
    assert proof["passed"] is True, proof["diagnosis"]
    metrics = json.loads((demo_run / "eval" / "metrics.json").read_text())
    assert metrics["acceptance"]["passed"] is True
    for split in ("dev", "test"):
        figures = metrics["selected_dev" if split == "dev" else "test"]
        assert figures[f"{split}_generated"] == 200
        assert 0.0 <= figures[f"{split}_exact_match"] <= 1.0 and figures[f"{split}_loss"] > 0
    # every later stage's output is there, about the same final state
    assert (demo_run / "publication.json").is_file() and (demo_run / "summary.json").is_file()
    result = json.loads((demo_run / "train" / "result.json").read_text())
    assert result["final_state_hash"] == metrics["final_state_hash"]


def _flax(directory: Path):
    from test_llama import _flax_model

    hf = json.loads((directory / "config.json").read_text())
    assert hf["rope_theta"] == 10000.0 and not hf["tie_word_embeddings"]  # Flax's own table
    return _flax_model(directory, hf)


@pytest.mark.slow
def test_the_export_loads_in_transformers_and_generate_prints_its_greedy_text(demo_run):
    import jax.numpy as jnp
    from transformers import AutoTokenizer

    from minifield.hf import checkpoint as hf_checkpoint
    from minifield.models import model

    directory = demo_run / "train" / "export"
    reference = _flax(directory)
    hf_tokenizer = AutoTokenizer.from_pretrained(str(directory))
    cfg, params = hf_checkpoint.load(directory, compute_dtype="float32")
    prompt_text = json.loads((directory / "dev.jsonl").read_text().splitlines()[0])["prompt"]
    prompt = hf_tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt_text}], add_generation_prompt=True
    )
    ids = np.asarray([prompt], np.int32)
    theirs = np.asarray(reference(ids).logits)[0]
    ours = model.forward(
        params,
        cfg,
        jnp.asarray(ids),
        jnp.ones_like(jnp.asarray(ids)),
        jnp.arange(len(prompt))[None],
    )
    np.testing.assert_allclose(np.asarray(ours)[0], theirs, atol=1e-4)

    generated = reference.generate(ids, max_new_tokens=20, do_sample=False)
    new = np.asarray(generated.sequences)[0, len(prompt) :].tolist()
    expected = hf_tokenizer.decode(new, skip_special_tokens=True)
    proc = run_generate(directory, prompt_text, 20)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == expected + "\n"
