"""lm-evaluation-harness ``loglikelihood`` on minifield: requests per second of the harness
model against a minimal loop over our forward scoring the same requests.

Writes a Llama export of the demo's size (byte tokenizer, FP32 weights; ``--d-model``,
``--layers``, ``--max-len``) to a temporary directory, makes multiple-choice-like requests
(a context of 16-40 bytes, four continuations of 3-8 bytes each), and times:

1. the harness model (``MinifieldLM.loglikelihood``: tokenized by lm-eval's ``TemplateLM``,
   sorted by length, rows padded to a multiple of 32, ``--batch`` rows per forward);
2. a minimal loop: the same token rows, ``--batch`` per call, padded to the longest row's
   multiple of 32, one jitted forward + log-softmax + gather each, summed in numpy.

Each is run once untimed (compilation) and then timed over ``--repeats`` runs; prints
requests/s of both and the ratio minimal ÷ harness (the goal: at most 1.2).

    uv run python benchmarks/harness_loglikelihood.py [--requests 400 --batch 32]
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from minifield.data import tokenizer as tokenizers
from minifield.hf import directory as hf_directory
from minifield.models import llama, model

BOS = 257


def write_export(directory: Path, args) -> None:
    cfg = llama.LlamaConfig(
        vocab_size=tokenizers.BYTE_VOCAB_SIZE,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=4,
        n_kv_heads=2,
        d_ff=4 * args.d_model,
        max_len=args.max_len,
        compute_dtype="float32",
    )
    params = jax.tree_util.tree_map(np.asarray, llama.init_params(cfg, jax.random.key(0)))
    tokenizer = tokenizers.byte_tokenizer()
    dev = b'{"prompt": "a", "response": "b"}\n'
    config = {
        "strategy": {"name": "packed-sft", "version": "12.0.0"},
        "model": cfg.to_dict(),
        "tokenizer": tokenizer.config(),
        "dev": {"file": "dev.jsonl", "sha256": hashlib.sha256(dev).hexdigest()},
    }
    hf_directory.write(
        directory, cfg, params, tokenizer, None, {"dev.jsonl": dev}, config, "float32"
    )


def requests(count: int) -> list[tuple[str, str]]:
    rng = np.random.default_rng(0)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz "))
    pairs = []
    while len(pairs) < count:
        # no trailing space: lm-eval would move it into the continuation
        context = "".join(rng.choice(letters, rng.integers(16, 41))).strip() or "a"
        for _ in range(4):
            pairs.append((context, " " + "".join(rng.choice(letters[:-1], rng.integers(3, 9)))))
    return pairs[:count]


@functools.partial(jax.jit, static_argnums=(1,))
def _score(params, cfg, tokens):
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    logits = model.forward(params, cfg, tokens, jnp.ones((B, T), jnp.int32), positions)
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    return jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[:, :, 0]


def minimal_loop(params, cfg, rows: list[tuple[list[int], int]], batch: int) -> list[float]:
    out = []
    for start in range(0, len(rows), batch):
        chunk = rows[start : start + batch]
        T = min(cfg.max_len, -(-max(len(r) for r, _ in chunk) // 32) * 32)
        tokens = np.zeros((batch, T), np.int32)
        for b, (row, _) in enumerate(chunk):
            tokens[b, : len(row)] = row
        logp = np.asarray(_score(params, cfg, jnp.asarray(tokens)))
        for b, (row, n) in enumerate(chunk):
            out.append(float(logp[b, len(row) - 1 - n : len(row) - 1].sum()))
    return out


def timed(fn, repeats: int) -> tuple[object, float]:
    result = fn()  # compile
    start = time.perf_counter()
    for _ in range(repeats):
        result = fn()
    return result, (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--max-len", type=int, default=64)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from lm_eval.api.instance import Instance

    from minifield.harness.model import MinifieldLM

    with tempfile.TemporaryDirectory() as tmp:
        write_export(Path(tmp) / "export", args)
        lm = MinifieldLM(path=str(Path(tmp) / "export"), batch_size=args.batch)
    pairs = requests(args.requests)
    instances = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    rows = [([BOS, *(c + x).encode()], len(x.encode())) for c, x in pairs]
    ours, ours_s = timed(lambda: lm.loglikelihood(instances, disable_tqdm=True), args.repeats)
    theirs, theirs_s = timed(
        lambda: minimal_loop(lm.loaded.params, lm.cfg, rows, args.batch), args.repeats
    )
    difference = max(abs(a[0] - b) for a, b in zip(ours, theirs, strict=True))
    print(
        f"requests {len(pairs)}, batch {args.batch}, d_model {args.d_model}, layers {args.layers}"
    )
    print(f"harness model: {len(pairs) / ours_s:9.1f} requests/s ({ours_s:.3f} s)")
    print(f"minimal loop:  {len(pairs) / theirs_s:9.1f} requests/s ({theirs_s:.3f} s)")
    print(f"harness time / minimal time: {ours_s / theirs_s:.2f} (goal <= 1.2)")
    print(f"largest log-likelihood difference: {difference:.2e}")


if __name__ == "__main__":
    main()
