"""Gradient accumulation (``training.grad_accum_steps``): k micro-batches of b rows are one
update of k·b rows.

The data are packed variable-length examples whose rows carry very different numbers of
trained tokens (one long answer per row next to rows holding a single one-letter answer),
so the two ways of combining micro-batches differ:

- the rule the step implements: the gradient of the *sum* of every micro-batch's losses,
  divided once by the trained tokens of the whole update — the full batch's token-weighted
  mean;
- the pitfall (computed here by the test itself, not by the code under test): the mean of
  the micro-batches' mean losses, which weighs a token of a sparse micro-batch more.

Tolerance: with FP32 compute the accumulated update and the full batch differ only in the
order of FP32 additions (per micro-batch partial sums). The gradients agree to relative 1e-5
of their norm. Parameters after four AdamW updates: AdamW divides each gradient entry by its
own root mean square, so an entry near zero turns a rounding difference into a difference
of up to the learning rate (measured: reordering the rows of the *same* full batch already
moves parameters by 2.5e-4 with eps 1e-8). The optimizer here uses eps 1e-4, which keeps
entries that small from being amplified; then the parameters agree to 1e-5 absolute
(6e-7 measured for k = 2), while the mean-of-means rule moves them by more than 1e-3
(a hundred times the tolerance).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from minifield import schemas
from minifield.data import encoding, packing
from minifield.data import tokenizer as tokenizers
from minifield.models import model
from minifield.models.gpt import ModelConfig
from minifield.models.llama import LlamaConfig
from minifield.training import lora, optimizer, train_step

SEQ, ROWS, UPDATES = 32, 8, 4
GRAD_RTOL, PARAM_ATOL, PITFALL_MIN = 1e-5, 1e-5, 1e-3


# one compiled program for every batch (all of one shape), not each primitive op by op
_loss_weights = jax.jit(model.loss_weights)


def _rows(examples) -> packing.Rows:
    packed = packing.pack(examples, SEQ, "truncate", tokenizers.byte_tokenizer().pad_id)
    return packed.rows


@pytest.fixture(scope="module")
def batches() -> list[packing.Rows]:
    """UPDATES batches of ROWS rows: even rows dense (one ~24-letter answer), odd rows sparse
    (a single one-letter answer: two trained tokens with its <eos>)."""
    tok = tokenizers.byte_tokenizer()
    rng = np.random.default_rng(7)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    out = []
    for _ in range(UPDATES):
        rows = []
        for r in range(ROWS):
            length = int(rng.integers(20, 27)) if r % 2 == 0 else 1
            word = "".join(rng.choice(letters, size=length))
            example = encoding.encode(encoding.Example(word[:3], word[::-1]), tok)
            rows.append(_rows([example]))  # one example per row: its own fill
        out.append(packing.Rows._make(map(np.concatenate, zip(*rows, strict=True))))
    per_row = np.concatenate([np.asarray(_loss_weights(b)).sum(axis=1) for b in out])
    assert per_row[0::2].min() >= 10 * per_row[1::2].max(), per_row  # dense vs sparse rows
    return out


@pytest.fixture(scope="module")
def setup():
    cfg = ModelConfig(
        vocab_size=tokenizers.byte_tokenizer().vocab_size, d_model=32, n_layers=1, n_heads=2,
        d_ff=64, max_len=SEQ, compute_dtype="float32",
    )  # fmt: skip
    training = {**schemas.defaults(schemas.TRAINING), "learning_rate": 1e-2, "warmup_steps": 0}
    training["eps"] = 1e-4  # see the module docstring: no amplified rounding noise
    tx = optimizer.make_optimizer(training, max_steps=UPDATES)
    return cfg, tx, train_step.init_train_state(cfg, tx, seed=3)


@pytest.fixture(scope="module")
def full_batch(setup, batches) -> dict:
    """The state after UPDATES plain updates of ROWS rows each (the reference)."""
    cfg, tx, state = setup
    return _train(train_step.make_train_step(cfg, tx), state, batches)


def _train(step_fn, state, batches):
    step = jax.jit(step_fn)
    for batch in batches:
        state, _ = step(state, jax.tree_util.tree_map(jnp.asarray, batch))
    return state


# on the host, in NumPy: op by op, jnp compiles each primitive afresh for every leaf's shape
def _max_difference(a, b) -> float:
    pairs = zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True)
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in pairs)


def _norm(tree) -> float:
    """The tree's global L2 norm (``optax.tree.norm``), in float64 on the host."""
    leaves = jax.tree_util.tree_leaves(tree)
    return float(np.sqrt(sum(np.sum(np.square(np.asarray(x, np.float64))) for x in leaves)))


# compiled (op by op, every primitive and loop is compiled on its own), the full batch's once
# for both values of k
_full_gradient = jax.jit(jax.value_and_grad(model.loss_fn, has_aux=True), static_argnums=1)
_accumulated_gradient = jax.jit(train_step.accumulated_gradient, static_argnums=(0, 2, 4))


# 25-40 s of compiling on this machine: in the slow tier, so the fast tier stays a quick loop
@pytest.mark.slow
@pytest.mark.parametrize("k", [2, 4])
def test_accumulated_gradient_is_the_full_batch_gradient(setup, batches, k):
    cfg, _, state = setup
    batch = jax.tree_util.tree_map(jnp.asarray, batches[0])
    (loss, aux), full = _full_gradient(state["params"], cfg, batch)
    (acc_loss, acc_aux), acc = _accumulated_gradient(model.loss_fn, state["params"], cfg, batch, k)
    assert float(acc_aux["tokens"]) == float(np.asarray(_loss_weights(batch)).sum())
    np.testing.assert_allclose(float(acc_loss), float(loss), rtol=1e-6)
    norm = _norm(full)
    assert _max_difference(full, acc) <= GRAD_RTOL * norm


@pytest.mark.parametrize("k", [2, pytest.param(4, marks=pytest.mark.slow)])  # fast tier: k = 2
def test_k_micro_batches_equal_one_batch_after_several_updates(setup, batches, full_batch, k):
    cfg, tx, state = setup
    accumulated = _train(train_step.make_train_step(cfg, tx, accum_steps=k), state, batches)
    assert int(accumulated["step"]) == UPDATES
    assert int(accumulated["cursor"]) == UPDATES * ROWS  # rows of whole updates
    assert _max_difference(full_batch["params"], accumulated["params"]) <= PARAM_ATOL


@pytest.mark.slow  # the negative control: the fast tier keeps the equality itself (k = 2)
def test_mean_of_micro_batch_means_differs_measurably(setup, batches, full_batch):
    """The pitfall, computed here: average the micro-batches' mean-loss gradients."""
    cfg, tx, state = setup
    k = 2

    def mean_of_means_step(state, batch):
        grads = []
        for i in range(k):
            micro = packing.Rows._make(value[i::k] for value in batch)  # rows i, i+k, ...
            grads.append(jax.grad(lambda p, m=micro: model.loss_fn(p, cfg, m)[0])(state["params"]))
        mean = jax.tree_util.tree_map(lambda *g: sum(g) / k, *grads)
        updates, opt_state = tx.update(mean, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {**state, "params": params, "opt_state": opt_state}, {}

    pitfall = _train(mean_of_means_step, state, batches)
    assert _max_difference(full_batch["params"], pitfall["params"]) > PITFALL_MIN


@pytest.mark.slow  # compile-heavy for the fast tier (5 CPU-s there); the full suite runs it
def test_lora_adapters_accumulate_as_one_batch(setup, batches):
    """LoRA trains adapters over a frozen base through the same update: k = 2 micro-batches
    give the adapters one batch gives (a tiny Llama base, FP32, the tolerance above)."""
    _, tx, _ = setup
    cfg = LlamaConfig(
        vocab_size=tokenizers.byte_tokenizer().vocab_size, d_model=32, n_layers=1, n_heads=2,
        n_kv_heads=1, d_ff=64, max_len=SEQ, compute_dtype="float32",
    )  # fmt: skip
    base = model.init_params(cfg, jax.random.key(1))
    settings = lora.LoraSettings(rank=4, alpha=8.0, targets=("q_proj", "v_proj"))
    start = lora.init_state(cfg, settings, tx, seed=3, identity=np.zeros(32, np.uint8))
    after = {}
    for k in (1, 2):
        step = jax.jit(lora.make_train_step(cfg, settings, tx, accum_steps=k))
        state = start
        for batch in batches:
            state, _ = step(state, base, jax.tree_util.tree_map(jnp.asarray, batch))
        after[k] = state["params"]
    assert _max_difference(after[1], start["params"]) > 100 * PARAM_ATOL  # they did train
    assert _max_difference(after[1], after[2]) <= PARAM_ATOL
