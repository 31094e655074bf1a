"""packed-sft's demo data: the string-reversal task (``sft-demo``), and the Llama demo's data —
the base model's pretraining corpus and tokenizer, the fine-tuning task.

The demo shows a pretrained start at work without a model hub, so the base model is one this
project trains itself (``config/recipes/llama-base.yaml``, shipped under ``data/llama-base/``)
and the demo (``config/recipes/llama-sft-demo.yaml``) fine-tunes it. Both tasks act on strings
of lowercase letters so a tiny model can learn them on a CPU in minutes:

- **pretraining** (the base): three instructions mixed, ``copy: s`` → ``s``,
  ``reverse: s`` → ``s`` reversed and ``sort: s`` → ``s``'s letters in ascending order;
- **fine-tuning** (the demo): an instruction the base never saw, ``mirror: s`` → ``s``
  followed by ``s`` reversed, i.e. copying and reversing composed in one answer.

The letters of a fine-tuning DEV/TEST string never occur as a string of the pretraining
corpus or the fine-tuning training split, so exact-match on them measures the new task, not
memory.

The tokenizer is character-level (a ``tokenizers`` BPE with no merges: one id per
character, ids 0..4 the special tokens ``<pad> <bos> <eos> <sep> <unk>``), so every letter is
its own token and the tasks stay letter-by-letter problems. The base model's chat template
(:data:`CHAT_TEMPLATE`) renders a user turn and the assistant's answer as
``<bos>prompt<sep>answer<eos>``: exactly the layout a recipe without a base model trains on
(:mod:`minifield.data.encoding`), so the base's pretraining and the demo's fine-tuning see one format and a
random-init run of the same fine-tuning recipe (a ``tokenizers-json`` recipe with this
``tokenizer.json``, ``benchmarks/pretrained_vs_random.py``) trains on the very same token ids.

:func:`produce_base` regenerates ``data/llama-base/`` (``minifield make-demo-data data
--llama-base config/recipes/llama-base.yaml``): it runs the base recipe through the worker's
API from a random initialisation and ships its HF export with the chat template added.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from ...atomic import write_bytes
from ...data.encoding import Example, to_jsonl
from ..lm import demo_files

ALPHABET = "abcdefghijklmnopqrstuvwxyz"
LENGTHS = (3, 8)
SEED = 20261201
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<sep>", "<unk>")
#: characters besides the letters that prompts use
PUNCTUATION = " :"
PRETRAIN_TASKS = {
    "copy": lambda s: s,
    "reverse": lambda s: s[::-1],
    "sort": lambda s: "".join(sorted(s)),
}
FINETUNE_TASK = ("mirror", lambda s: s + s[::-1])
PRETRAIN_SPLITS = {"train": 4000, "dev": 100, "test": 100}  # strings per task
FINETUNE_SPLITS = {"train": 2000, "dev": 200, "test": 200}

#: user turn → ``<bos>content<sep>``; assistant turn → ``content<eos>``; system turns are not
#: part of this model's format. ``add_generation_prompt`` adds nothing: the ``<sep>`` after the
#: user turn already asks for the answer.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ bos_token }}{{ message['content'] }}<sep>"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] }}{{ eos_token }}"
    "{% else %}{{ raise_exception('only user and assistant turns are supported') }}"
    "{% endif %}{% endfor %}"
)


def _strings(rng: random.Random, count: int, seen: set[str], lengths=LENGTHS) -> list[str]:
    """``count`` new lowercase strings of ``lengths`` (inclusive), none in ``seen`` (added)."""
    low, high = lengths
    out = []
    while len(out) < count:
        length = low + rng.randrange(high - low + 1)
        word = "".join(ALPHABET[rng.randrange(len(ALPHABET))] for _ in range(length))
        if word in seen:
            continue
        seen.add(word)
        out.append(word)
    return out


def examples(seed: int = SEED) -> dict[str, dict[str, list[Example]]]:
    """``{"pretrain": splits, "finetune": splits}``, deterministic in ``seed``; every string
    occurs once across all splits of both (Python's ``random.Random`` ``randrange`` sequence
    is stable across versions)."""
    rng = random.Random(seed)
    seen: set[str] = set()
    pretrain: dict[str, list[Example]] = {}
    for split, count in PRETRAIN_SPLITS.items():
        rows = [
            Example(f"{name}: {word}", task(word))
            for name, task in PRETRAIN_TASKS.items()
            for word in _strings(rng, count, seen)
        ]
        rng.shuffle(rows)
        pretrain[split] = rows
    name, task = FINETUNE_TASK
    finetune = {
        split: [Example(f"{name}: {word}", task(word)) for word in _strings(rng, count, seen)]
        for split, count in FINETUNE_SPLITS.items()
    }
    return {"pretrain": pretrain, "finetune": finetune}


def tokenizer_json() -> bytes:
    """The character-level ``tokenizer.json``: a BPE without merges over the special tokens,
    the prompt punctuation and the letters (unknown characters become ``<unk>``)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for char in PUNCTUATION + ALPHABET:
        vocab[char] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS]
    )
    return backend.to_str().encode("utf-8")


def write(data_root: Path, seed: int = SEED) -> dict[str, str]:
    """Write the demo's inputs under ``data_root``: ``llama-base/tokenizer.json``,
    ``llama-base/pretrain/{split}.jsonl`` and ``llama-sft-demo/{split}.jsonl``. Returns each
    written path (relative to ``data_root``) → sha256, for the recipes' pins."""
    files = {"llama-base/tokenizer.json": tokenizer_json()}
    parts = examples(seed)
    for split, rows in parts["pretrain"].items():
        files[f"llama-base/pretrain/{split}.jsonl"] = to_jsonl(rows)
    for split, rows in parts["finetune"].items():
        files[f"{demo_files.MIRROR_DIR}/{split}.jsonl"] = to_jsonl(rows)
    return demo_files.write(data_root, files)


# -- the base model ---------------------------------------------------------------------------

BASE_DIR = "llama-base"
#: files of the export that form the shipped base model (plus the tokenizer_config written here)
BASE_EXPORT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json")
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
PROVENANCE_FILE = "provenance.json"


class ProduceError(Exception):
    """The base model could not be produced (a recipe pin disagreeing with the data, a failed
    run); the message says which."""


def base_tokenizer_config(exported: dict) -> dict:
    """The shipped ``tokenizer_config.json``: the export's (special tokens and their ids) plus
    ``<unk>`` and the :data:`CHAT_TEMPLATE` a base model needs."""
    config = json.loads(json.dumps(exported))
    unk_id = SPECIAL_TOKENS.index("<unk>")
    config["unk_token"] = "<unk>"
    decoder = config["added_tokens_decoder"]
    decoder[str(unk_id)] = {**decoder[str(SPECIAL_TOKENS.index("<pad>"))], "content": "<unk>"}
    config["chat_template"] = CHAT_TEMPLATE
    return config


def produce_base(data_root: Path, recipe_path: Path, result, command: str) -> dict:
    """Write the HF export of the base recipe's run (``result``: the ``minifield.run`` result
    of training it from its random initialisation on the inputs under ``data_root``) into
    ``data_root/llama-base/`` with the chat template and a provenance record; returns the
    provenance."""
    from ...digest import sha256_file

    if not result.ok:
        raise ProduceError(f"{recipe_path}: the run ended {result.status}: {result.error}")
    export_dir = result.attempt_dir / "export"
    target = data_root / BASE_DIR
    target.mkdir(parents=True, exist_ok=True)
    for name in BASE_EXPORT_FILES:
        data = (export_dir / name).read_bytes()
        if name == "tokenizer.json" and data != (target / name).read_bytes():
            raise ProduceError(f"{export_dir / name}: differs from the pinned {target / name}")
        write_bytes(target / name, data)
    exported = json.loads((export_dir / TOKENIZER_CONFIG_FILE).read_text(encoding="utf-8"))
    config = base_tokenizer_config(exported)
    write_bytes(
        target / TOKENIZER_CONFIG_FILE, (json.dumps(config, indent=2) + "\n").encode("utf-8")
    )
    attempt = json.loads((result.attempt_dir / "attempt.json").read_text(encoding="utf-8"))
    provenance = {
        "command": command,
        "recipe": str(recipe_path),
        "recipe_sha256": sha256_file(recipe_path),
        "computation_digest": result.computation_digest,
        "examples_digest": attempt["examples_digest"],
        "final_state_hash": result.final_state_hash,
        "steps": result.steps_completed,
        "pretraining_dev_metrics": result.metrics,
        "environment": {
            key: attempt["environment"][key]
            for key in ("backend", "device_kind", "jax", "jaxlib", "numpy", "optax", "python")
        },
        "export": "the attempt's export/ (final state, FP32 safetensors), tokenizer_config.json "
        "with <unk> and chat_template added",
        "files": {
            name: sha256_file(target / name) for name in (*BASE_EXPORT_FILES, TOKENIZER_CONFIG_FILE)
        },
    }
    write_bytes(target / PROVENANCE_FILE, (json.dumps(provenance, indent=2) + "\n").encode("utf-8"))
    return provenance


# -- the packed-sft demo: reverse a string ---------------------------------------------------


DEMO_SPLITS = {"train": 4000, "dev": 200, "test": 200}
DEMO_LENGTHS = (3, 6)
DEMO_SEED = 20260101


def demo_examples(
    seed: int = DEMO_SEED, sizes: dict[str, int] | None = None
) -> dict[str, list[Example]]:
    """Reverse a 3–6 letter string: disjoint train/dev/test splits, answers checkable exactly.

    Deterministic in ``seed`` (Python's ``random.Random`` sequence is stable
    across versions for ``randrange``); no string occurs in two splits.
    """
    sizes = dict(sizes or DEMO_SPLITS)
    rng = random.Random(seed)
    seen: set[str] = set()
    splits: dict[str, list[Example]] = {}
    for split, count in sizes.items():
        words = _strings(rng, count, seen, DEMO_LENGTHS)
        splits[split] = [Example(word, word[::-1]) for word in words]
    return splits


def write_demo(directory: Path, seed: int = DEMO_SEED) -> dict[str, str]:
    """Write ``{split}.jsonl`` into ``directory``; returns split → sha256 (for recipe pins)."""
    files = {f"{split}.jsonl": to_jsonl(rows) for split, rows in demo_examples(seed).items()}
    return {Path(name).stem: pin for name, pin in demo_files.write(directory, files).items()}
