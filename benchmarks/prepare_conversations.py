"""Preparing conversations: examples per second against a minimal render-and-encode loop.

Generates N three-turn conversations (a system message, three user questions, three
assistant answers: reverse / upper-case / count the letters of random words) as a
``messages`` JSONL file, and a byte-level BPE ``tokenizer.json`` trained on a sample of them
with ChatML's specials. Then, on the same file and tokenizer:

- **minimal loop**: ``json.loads`` per line, the ChatML template rendered once per
  conversation with plain jinja2 (transformers' environment settings, no sandbox), and
  ``tokenizers``' ``encode_batch`` over all texts: the tokens of every conversation, but no
  trained spans, no checks, no sandbox;
- **prepare**: what the packed-sft prepare stage does with a base model's template: read and
  check the file, render in the bounded sandbox, find every assistant turn's trained span
  (:func:`minifield.hf.pinned_base.read_and_encode_chat`, ``all_assistant``),
  on as many processes as the prepare stage uses (``MINIFIELD_PREPARE_WORKERS``, else the
  CPUs).

Printed: examples/s of each, their ratio (goal ≥ 0.5), the load average before and after, and
the packing fill of the prepared examples in rows of ``--seq-len`` (goal ≥ 97 %) with the
sha256 of the packed arrays (``prepared_sha256``: equal before and after a change that must
not change the prepared bytes). Unlike a state hash, that sha256 is a property of the code and
its inputs, not of the machine: nothing on the way is floating-point work (the conversations
from Python's ``random.Random``, BPE training and encoding by ``tokenizers``, which count and
compare integers, the template rendered as text, first-fit packing; ``loss_mask`` is FP32 but
only ever holds the assigned 0.0 and 1.0), and no XLA, so the value quoted in
docs/packed-sft.md (``288f1312…``, for the defaults) is expected on any CPU with the lock's
``tokenizers``, and with any number of prepare workers. With ``--repeat R`` the two are timed R
times, alternately, and the fastest of each counts (on a shared machine the slower runs
measure the other jobs).

Usage: uv run python benchmarks/prepare_conversations.py [--n 100000] [--seq-len 2048]
[--repeat 1] [--json OUT]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

from minifield.data import chat_template, encode_pool, formats, packing
from minifield.data import tokenizer as tk
from minifield.hf import pinned_base

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def conversations(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        words = ["".join(rng.choices(LETTERS, k=rng.randint(3, 12))) for _ in range(3)]
        rows.append(
            {
                "messages": [
                    {"role": "system", "content": "You answer in one word."},
                    {"role": "user", "content": f"Reverse the word {words[0]}."},
                    {"role": "assistant", "content": words[0][::-1]},
                    {"role": "user", "content": f"Now write {words[1]} in capitals."},
                    {"role": "assistant", "content": words[1].upper()},
                    {"role": "user", "content": f"How many letters has {words[2]}?"},
                    {"role": "assistant", "content": str(len(words[2]))},
                ]
            }
        )
    return rows


def make_tokenizer(rows: list[dict], path: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=2000,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    sample = (m["content"] for r in rows[:2000] for m in r["messages"])
    tok.train_from_iterator(sample, trainer)
    tok.save(str(path))
    return path


def minimal_loop(data: Path, tokenizer_path: Path) -> int:
    """json → jinja2 render → encode_batch: the floor any preparation has to pay."""
    import jinja2
    from tokenizers import Tokenizer

    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    template = env.from_string(CHATML)
    backend = Tokenizer.from_file(str(tokenizer_path))
    with open(data, encoding="utf-8") as handle:
        texts = [template.render(messages=json.loads(line)["messages"]) for line in handle]
    encodings = backend.encode_batch(texts, add_special_tokens=False)
    return len(encodings)


def prepare(data: Path, tokenizer_path: Path, seq_len: int) -> tuple[int, list]:
    tokenizer, strings = tk.from_base_model(
        tokenizer_path.read_bytes(),
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        str(tokenizer_path),
        "tokenizer_config.json",
    )
    template = chat_template.ChatTemplate(CHATML, strings, "chatml", positions=seq_len)
    encoded, _ = pinned_base.read_and_encode_chat(
        data, formats.Source(), tokenizer, template, "all_assistant", encode_pool.workers()
    )
    return len(encoded), encoded


def timed(function, *args):
    started = time.perf_counter()
    out = function(*args)
    return out, time.perf_counter() - started


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        rows = conversations(args.n)
        data = Path(tmp) / "train.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        tokenizer_path = make_tokenizer(rows, Path(tmp) / "tokenizer.json")
        baseline_s = ours_s = float("inf")
        for _ in range(args.repeat):
            count, seconds = timed(minimal_loop, data, tokenizer_path)
            baseline_s = min(baseline_s, seconds)
            (ours, encoded), seconds = timed(prepare, data, tokenizer_path, args.seq_len)
            ours_s = min(ours_s, seconds)
            assert count == ours == args.n
        packed, pack_s = timed(packing.pack, encoded, args.seq_len, "reject", 0)
    digest = hashlib.sha256()
    arrays = packed.rows._asdict()  # the fields by name, as the digest has always read them
    for key in sorted(arrays):
        digest.update(key.encode())
        digest.update(arrays[key].tobytes())
    result = {
        "conversations": args.n,
        "minimal_loop_examples_per_s": args.n / baseline_s,
        "prepare_examples_per_s": args.n / ours_s,
        "ratio": baseline_s / ours_s,
        "repeat": args.repeat,
        "workers": encode_pool.workers(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "pack_seconds": pack_s,
        "seq_len": args.seq_len,
        "packing_fill": packed.stats["efficiency"],
        "trained_tokens": packed.stats["loss_tokens"],
        "tokens": packed.stats["real_tokens"],
        "prepared_sha256": digest.hexdigest(),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
