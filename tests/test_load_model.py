"""``minifield.load_model`` and sampled generation (``minifield generate``'s flags).

References, none of them this project's code:
- the float64 NumPy forward of HF's Llama written in ``test_llama`` from the equations, and
  transformers' ``FlaxLlamaForCausalLM`` (``hf-reference`` group; its rotary table hard-codes
  base 10000, so the config here uses that base) for the logits and greedy tokens;
- transformers' ``PreTrainedTokenizerFast`` on the same ``tokenizer.json`` for the prompt ids
  (``apply_chat_template`` with the generation prompt, and ``tokenizer(text)`` for raw text);
- the filtered softmax computed by hand below for the sampling rules (temperature, top-k,
  then top-p, as transformers orders its warpers).

The tiny HF directory is written by the test: random tensors under HF names
(``test_llama.hf_tensors``), a byte-level BPE trained here with Llama 3 special tokens and a
post-processor that adds ``<|begin_of_text|>``, a Llama 3 chat template, and a
``generation_config.json`` with a list of eos ids.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import test_llama
from conftest import minifield_in_process
from test_chat_template import LLAMA3, make_tokenizer

import minifield
from minifield.hf import directory as hf_directory
from minifield.hf.loaded_model import ModelLoadError
from minifield.models import model
from minifield.models import sampling as sampling_rules
from minifield.models.sampling import GenerationDefaults, Sampling

BOS, EOT = "<|begin_of_text|>", "<|eot_id|>"
HF = {
    **test_llama.LLAMA,
    "vocab_size": 320,
    "max_position_embeddings": 64,
    "rope_theta": 10000.0,  # transformers' Flax Llama uses this base whatever the config says
}
ROWS = [
    [1, 50, 70, 90, 110, 130, 2, 260, 3, 3, 40, 17],
    [300, 0, 4, 8, 15, 16, 23, 42, 8, 1, 9, 30],
]


def write_hf_directory(directory: Path, seed: int = 0, generation: dict | None = None) -> dict:
    """An HF directory as a user downloads one; returns its tensors and token ids."""
    from tokenizers import Tokenizer, processors

    tensors = test_llama.hf_tensors(HF, seed)
    test_llama.write_checkpoint(directory, HF, tensors)
    path = make_tokenizer(directory / "tokenizer.json", vocab_size=HF["vocab_size"])
    backend = Tokenizer.from_file(str(path))
    bos, eot = backend.token_to_id(BOS), backend.token_to_id(EOT)
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, bos)]
    )
    backend.save(str(path))
    tokenizer_config = {"bos_token": BOS, "eos_token": EOT, "chat_template": LLAMA3}
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    if generation is not None:
        (directory / "generation_config.json").write_text(json.dumps(generation))
    return {"tensors": tensors, "bos": bos, "eot": eot, "backend": backend}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> tuple[Path, dict]:
    directory = tmp_path_factory.mktemp("hf") / "model"
    return directory, write_hf_directory(directory)


def reference_tokenizer(directory: Path):
    from transformers import PreTrainedTokenizerFast

    ref = PreTrainedTokenizerFast(
        tokenizer_file=str(directory / "tokenizer.json"), bos_token=BOS, eos_token=EOT
    )
    ref.chat_template = LLAMA3
    return ref


# -- loading and logits (fast) --------------------------------------------------------------


def test_logits_equal_the_written_equations_batched_and_alone(hf_dir):
    directory, made = hf_dir
    loaded = minifield.load_model(directory)
    assert loaded.cfg.compute_dtype == "float32" and loaded.cfg.max_len == 64
    batched = loaded.logits(ROWS)
    assert batched.shape == (2, 12, 320) and batched.dtype == np.float32
    for row, logits in zip(ROWS, batched, strict=True):
        reference = test_llama.reference_logits(made["tensors"], HF, row)
        np.testing.assert_allclose(logits, reference, atol=1e-4)
    np.testing.assert_allclose(loaded.logits(ROWS[1]), batched[1], atol=1e-5)
    # a right-padded row: the real slots' logits are those of the row alone (causal)
    padded = loaded.logits([ROWS[0][:5] + [0] * 7])
    np.testing.assert_allclose(padded[0, :5], loaded.logits(ROWS[0][:5]), atol=1e-5)
    with pytest.raises(ValueError, match=r"token id 320 is outside the vocabulary \(0..319\)"):
        loaded.logits([[1, 320]])


def test_an_export_of_the_same_weights_gives_the_same_logits_and_prompts(hf_dir, tmp_path):
    """The export path (model.json, sha256-checked files, ExportedModel) and the HF path."""
    directory, _ = hf_dir
    loaded = minifield.load_model(directory)
    export_dir = tmp_path / "export"
    dev = b'{"prompt": "a", "response": "b"}\n'
    config = {
        "strategy": {"name": "packed-sft", "version": "12.0.0"},
        "model": loaded.cfg.to_dict(),
        "tokenizer": {
            "kind": "base-model",
            "file": "tokenizer.json",
            "config_file": "tokenizer_config.json",
            "vocab_size": loaded.tokenizer.vocab_size,
        },
        "dev": {"file": "dev.jsonl", "sha256": "0" * 64},
    }
    hf_directory.write(
        export_dir,
        loaded.cfg,
        loaded.params,
        loaded.tokenizer,
        (directory / "tokenizer.json").read_bytes(),
        {"dev.jsonl": dev},
        config,
        "float32",
        (directory / "tokenizer_config.json").read_bytes(),
        HF,
    )
    exported = minifield.load_model(export_dir)
    assert type(exported).__name__ == "ExportedModel"
    np.testing.assert_allclose(exported.logits(ROWS), loaded.logits(ROWS), atol=1e-6)
    prompt = "reverse: hello"
    assert exported.prompt_ids(prompt) == loaded.prompt_ids(prompt)
    assert exported.prompt_ids(prompt, chat_template=False) == loaded.prompt_ids(
        prompt, chat_template=False
    )
    assert minifield.load_model(export_dir, compute_dtype="bfloat16").cfg.compute_dtype == (
        "bfloat16"
    )


def test_prompts_are_transformers_chat_template_or_raw_tokenization(hf_dir):
    directory, made = hf_dir
    loaded = minifield.load_model(directory)
    ref = reference_tokenizer(directory)
    text = "reverse: hello world"
    expected = ref.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
    )
    assert loaded.prompt_ids(text) == list(expected)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}]
    expected = ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert loaded.prompt_ids(messages) == list(expected)
    # raw continuation: the post-processor's <|begin_of_text|>, then the text, nothing else
    raw = loaded.prompt_ids(text, chat_template=False)
    assert raw == ref(text).input_ids
    assert raw[0] == made["bos"] and EOT not in ref.convert_ids_to_tokens(raw)
    with pytest.raises(ValueError, match="messages need the chat template"):
        loaded.prompt_ids(messages, chat_template=False)


def test_stop_ids_are_every_eos_id_of_both_configs_and_the_tokenizer(tmp_path):
    made = write_hf_directory(tmp_path / "m", generation={"eos_token_id": [7, 9]})
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "eos_token_id": [9, 11]}))
    loaded = minifield.load_model(tmp_path / "m")
    assert loaded.stop_ids == tuple(sorted({7, 9, 11, made["eot"]}))


@pytest.mark.parametrize(
    "generation, message",
    [
        ({"temperature": "hot"}, r"generation_config.json: temperature must be a number >= 0"),
        ({"top_p": 1.5}, r"generation_config.json: top_p must be a number > 0 and <= 1"),
        ({"do_sample": "yes"}, r"generation_config.json: do_sample must be true or false"),
        ({"eos_token_id": ["x"]}, r"generation_config.json: eos_token_id must be a token id"),
    ],
)
def test_a_bad_generation_config_is_refused_naming_file_and_field(tmp_path, generation, message):
    write_hf_directory(tmp_path / "m", generation=generation)
    with pytest.raises(ModelLoadError, match=message):
        minifield.load_model(tmp_path / "m")


def test_a_directory_missing_its_tokenizer_or_weights_is_refused_naming_it(tmp_path):
    directory = tmp_path / "m"
    write_hf_directory(directory)
    (directory / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match=r"m: unreadable tokenizer files .*tokenizer.json"):
        minifield.load_model(directory)
    (directory / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"m: neither model.safetensors nor"):
        minifield.load_model(directory)
    with pytest.raises(ModelLoadError, match=r"none: not a directory"):
        minifield.load_model(tmp_path / "none")
    (directory / "config.json").unlink()
    with pytest.raises(
        ModelLoadError, match=r"m: neither a minifield export \(model.json missing\) nor an HF"
    ):
        minifield.load_model(directory)


# -- the sampling rules (fast) --------------------------------------------------------------

#: probabilities chosen so that every cut-off falls clearly between two cumulative sums
P = np.array([0.4, 0.3, 0.15, 0.1, 0.05])
LOGITS = np.log(P).astype(np.float32)


def _softmax_of_kept(logits, kept):
    e = np.where(kept, np.exp(logits - logits.max()), 0.0)
    return e / e.sum()


def _filtered_probs(sampling: Sampling) -> np.ndarray:
    filtered = np.asarray(sampling_rules.filter_logits(jax.numpy.asarray(LOGITS[None]), sampling))
    return np.asarray(jax.nn.softmax(filtered[0]))


@pytest.mark.parametrize(
    "sampling, expected",
    [
        # nothing cut: the softmax itself
        (Sampling(1.0, 0, 1.0), P),
        # top-p 0.6: 0.4 < 0.6, 0.4 + 0.3 >= 0.6, so the nucleus is the first two
        (Sampling(1.0, 0, 0.6), np.array([0.4, 0.3, 0, 0, 0]) / 0.7),
        (Sampling(1.0, 0, 0.75), np.array([0.4, 0.3, 0.15, 0, 0]) / 0.85),
        (Sampling(1.0, 3, 1.0), np.array([0.4, 0.3, 0.15, 0, 0]) / 0.85),
        # top-k first: over the top two, renormalised to 4/7 and 3/7, the nucleus of 0.5 is the
        # first alone (top-p first would have kept two: 0.4 < 0.5)
        (Sampling(1.0, 2, 0.5), np.array([1.0, 0, 0, 0, 0])),
        # temperature 2 divides the log-probabilities: p^(1/2), renormalised
        (Sampling(2.0, 0, 1.0), np.sqrt(P) / np.sqrt(P).sum()),
        # temperature 0.5, then the nucleus of 0.8 over p^2 / sum p^2: 0.16/0.285 = 0.561 < 0.8,
        # + 0.09/0.285 = 0.877: two kept
        (Sampling(0.5, 0, 0.8), np.array([0.16, 0.09, 0, 0, 0]) / 0.25),
    ],
)
def test_the_filter_keeps_exactly_the_hand_computed_set(sampling, expected):
    np.testing.assert_allclose(_filtered_probs(sampling), expected, atol=1e-6)


def test_draws_over_many_seeds_follow_the_filtered_softmax():
    sampling = Sampling(1.0, 0, 0.75)
    expected = np.array([0.4, 0.3, 0.15, 0, 0]) / 0.85
    n = 6000
    logits = jax.numpy.asarray(LOGITS[None])
    draw = jax.jit(jax.vmap(lambda seed: sampling_rules.choice(sampling, seed)(logits, 0)[0]))
    tokens = np.asarray(draw(jax.numpy.arange(n, dtype=jax.numpy.uint32)))
    counts = np.bincount(tokens, minlength=5)
    assert counts[3] == counts[4] == 0  # outside the nucleus: never drawn
    sigma = np.sqrt(n * expected * (1 - expected))
    assert (np.abs(counts - n * expected) <= 5 * sigma + 1e-9).all(), (counts, n * expected)
    # greedy is the argmax; the same seed draws the same token, another seed may not
    assert int(sampling_rules.choice(None, 0)(logits, 0)[0]) == 0
    again = np.asarray(draw(jax.numpy.arange(n, dtype=jax.numpy.uint32)))
    np.testing.assert_array_equal(again, tokens)


def test_flags_win_over_generation_config_which_wins_over_transformers_defaults():
    llama3_instruct = GenerationDefaults(do_sample=True, temperature=0.6, top_p=0.9)
    assert sampling_rules.resolve(llama3_instruct) == Sampling(0.6, 50, 0.9)
    assert sampling_rules.resolve(llama3_instruct, top_k=5, top_p=1.0) == Sampling(0.6, 5, 1.0)
    assert sampling_rules.resolve(llama3_instruct, temperature=0) is None  # 0: greedy
    assert sampling_rules.resolve(GenerationDefaults()) is None  # greedy by default
    assert sampling_rules.resolve(GenerationDefaults(temperature=0.7)) is None  # no do_sample
    assert sampling_rules.resolve(GenerationDefaults(), top_p=0.5) == Sampling(1.0, 50, 0.5)
    with pytest.raises(ValueError, match=r"^top_k must be a whole number >= 0, got -1$"):
        sampling_rules.resolve(GenerationDefaults(), top_k=-1)


# -- generation (slow: each test compiles generation loops) ---------------------------------


@pytest.mark.slow
def test_same_seed_same_tokens_different_seeds_differ_on_a_flat_distribution(hf_dir):
    directory, _ = hf_dir
    loaded = minifield.load_model(directory)
    flat = loaded.with_compute_dtype("float32")
    # a zero output head: every logit 0, every token equally likely
    flat.params = {**loaded.params, "head": {"w": loaded.params["head"]["w"] * 0.0}}
    flat.stop_ids = ()
    prompt = loaded.prompt_ids("hello")

    def sample(seed):
        return flat.generate_ids(prompt, 12, temperature=1.0, top_k=0, seed=seed)

    first = sample(3)
    assert len(first) == 12 and sample(3) == first
    others = [sample(seed) for seed in (4, 5)]
    assert all(other != first for other in others)
    assert len(set(first + others[0] + others[1])) > 12  # spread over the vocabulary


@pytest.mark.slow
def test_top_k_one_equals_greedy_with_and_without_the_cache(hf_dir):
    directory, _ = hf_dir
    loaded = minifield.load_model(directory)
    prompts = [loaded.prompt_ids("hello"), ROWS[1]]
    for cache in (True, False):
        greedy = model.generate_batch(loaded.params, loaded.cfg, prompts, 10, None, cache)
        top1 = model.generate_batch(
            loaded.params, loaded.cfg, prompts, 10, None, cache, Sampling(1.3, 1, 1.0), seed=9
        )
        assert top1 == greedy and [len(g) for g in greedy] == [10, 10]


@pytest.mark.slow
def test_generation_stops_on_each_id_of_an_eos_list(tmp_path):
    made = write_hf_directory(tmp_path / "m")
    free = minifield.load_model(tmp_path / "m")
    free.stop_ids = ()
    prompt = free.prompt_ids("hello")
    tokens = free.generate_ids(prompt, 14)
    # the tokenizer's eos always stops: only the tokens before it can be tried
    end = tokens.index(made["eot"]) if made["eot"] in tokens else len(tokens)
    unused = [i for i in range(320) if i not in tokens and i != made["eot"]][:2]
    positions = sorted({tokens.index(t) for t in tokens[:end]} - {0})[:3]
    assert len(positions) == 3, tokens
    for position in positions:
        eos = [unused[0], tokens[position], unused[1]]
        (tmp_path / "m" / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
        loaded = minifield.load_model(tmp_path / "m")
        assert set(eos) <= set(loaded.stop_ids) and made["eot"] in loaded.stop_ids
        assert loaded.generate_ids(prompt, 14) == tokens[:position], eos


# -- transformers' Flax Llama and the real command (slow) -----------------------------------


def _minifield(*args) -> subprocess.CompletedProcess:
    """The installed ``minifield`` command, as a user runs it."""
    command = Path(sys.executable).parent / "minifield"
    return subprocess.run(
        [str(command), *map(str, args)], capture_output=True, text=True, timeout=600, check=False
    )


@pytest.mark.slow
def test_logits_greedy_text_and_the_command_equal_transformers_flax(tmp_path):
    directory = tmp_path / "model"
    made = write_hf_directory(directory)
    # transformers' Flax generate takes one eos id: it generates on, and the reference's
    # tokens are cut at the first of the list below
    reference = test_llama._flax_model(directory, HF)
    stops = (5, 6, made["eot"])
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 6]}))
    loaded = minifield.load_model(directory)
    theirs = np.asarray(reference(np.asarray(ROWS, np.int32)).logits)
    np.testing.assert_allclose(loaded.logits(ROWS), theirs, atol=1e-4)

    ref = reference_tokenizer(directory)
    text = "reverse: hello"
    prompts = {
        "chat": ref.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        ),
        "raw": ref(text).input_ids,
    }
    expected = {}
    for name, ids in prompts.items():
        generated = reference.generate(
            np.asarray([ids], np.int32),
            max_new_tokens=10,
            do_sample=False,
            pad_token_id=0,
        ).sequences
        new = np.asarray(generated)[0, len(ids) :].tolist()
        ends = [i for i, t in enumerate(new) if t in stops]
        new = new[: ends[0]] if ends else new
        assert new, f"{name}: the reference stops at once, which would compare nothing"
        assert loaded.generate_ids(list(ids), 10) == new
        expected[name] = ref.decode(new, skip_special_tokens=True)
    chat = _minifield("generate", "--model", directory, "--prompt", text, "--max-new-tokens", 10)
    assert (chat.returncode, chat.stdout, chat.stderr) == (0, expected["chat"] + "\n", "")
    raw = _minifield(
        "generate", "--model", directory, "--prompt", text, "--max-new-tokens", 10,
        "--no-chat-template",
    )  # fmt: skip
    assert (raw.returncode, raw.stdout) == (0, expected["raw"] + "\n"), raw.stderr

    # sampling flags: the same seed prints the same text in two processes (different seeds
    # differing is checked in process, above)
    sampled = [
        _minifield(
            "generate",
            "--model",
            directory,
            "--prompt",
            text,
            "--prompt",
            "sort: cab",
            "--max-new-tokens",
            12,
            "--temperature",
            5,
            "--top-k",
            0,
            "--seed",
            1,
        )  # fmt: skip
        for _ in range(2)
    ]
    assert all(proc.returncode == 0 for proc in sampled), sampled[0].stderr
    assert sampled[0].stdout == sampled[1].stdout
    assert sampled[0].stdout != chat.stdout  # sampled, not greedy


@pytest.mark.slow
def test_bad_flags_and_a_bad_generation_config_exit_2_with_one_line(hf_dir, tmp_path):
    directory, _ = hf_dir
    # the installed command for the first flag; the others through its main() in this process
    # (the same parser and exit, without a process start of ~1 CPU-s each)
    for n, (flag, value) in enumerate((("--top-p", "1.5"), ("--temperature", "-1"),
                                       ("--top-k", "x"), ("--seed", "-3"),
                                       ("--temperature", "nan"))):  # fmt: skip
        args = ("generate", "--model", directory, "--prompt", "a", flag, value)
        proc = _minifield(*args) if n == 0 else minifield_in_process(*args)
        assert proc.returncode == 2 and proc.stdout == ""
        lines = proc.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"minifield generate: argument {flag}:")
    write_hf_directory(tmp_path / "m", generation={"do_sample": True, "top_k": 2.5})
    proc = _minifield("generate", "--model", tmp_path / "m", "--prompt", "a")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == (
        f"minifield generate: {tmp_path / 'm' / 'generation_config.json'}: top_k must be a "
        "whole number >= 0, got 2.5\n"
    )


def test_the_readme_load_model_example_runs_on_the_shipped_base(monkeypatch, capsys):
    """The README's ``load_model`` block, run as written from the repository root: the demo
    base (pretrained on copy, reverse and sort, docs/pretrained.md) reverses "abc" greedily."""
    from conftest import REPO

    section = (REPO / "README.md").read_text().split("## Python API", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    code = next(block for block in blocks if "load_model" in block)
    monkeypatch.chdir(REPO)
    exec(compile(code, "README.md", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "cba" and len(printed) == 2
