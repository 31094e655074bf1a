"""grpo's gradient accumulation (``training.grad_accum_steps``): the update's N completions
trained as k micro-batches of every k-th row are the update of one batch, within FP32
rounding: the same losses, metrics, returned log-probabilities and, after a few updates of μ
iterations each, the same parameters.

Hand-made batches through :func:`minifield.strategies.grpo.update.make_update` on a tiny
Llama (FP32): completions of very different lengths (an empty one among them, so a
micro-batch's token count differs from another's), random advantages in groups, a reference
(k3 KL) and μ = 2 (iteration 2 clips against iteration 1's log-probabilities, so the clip
shares are not all 0).

Tolerance: with FP32 compute, k micro-batches change only the order of FP32 additions (each
micro-batch's partial sums of the loss and the gradient). The first update's loss and metrics
agree to relative 1e-5 (measured: 1.6e-6 at most; max |Δ loss| over every update 2.1e-7).
Parameters after three updates agree to 1e-5 of the parameters' scale (see
:data:`PARAM_RTOL`; measured: 1.1e-6, max |Δ| 4.3e-7): AdamW divides each gradient entry by
its own root mean square, which amplifies rounding in entries near 0
(tests/test_grad_accum.py), so the optimizer's eps here is 1e-4 as there.

bnpo is the loss type whose value depends on the split: its weights
(``token_weights(..., micro_batches=k)``) normalise each micro-batch of every k-th row by its
own tokens, exactly the rows the update accumulates together; with the same weights, one batch
and k micro-batches are again the same update.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from minifield import schemas
from minifield.models import model
from minifield.models.llama import LlamaConfig
from minifield.rl import objective
from minifield.rl.advantages import token_weights
from minifield.strategies.grpo import update as grpo_update
from minifield.strategies.grpo.rollouts_file import Batch
from minifield.training import lora, optimizer, train_step

N, S, G, L, VOCAB = 8, 20, 4, 10, 48
UPDATES, MU, TEMPERATURE, BETA = 3, 2, 1.3, 0.04
FIRST_RTOL, PARAM_RTOL = 1e-5, 1e-5
METRICS = (
    "loss",
    "loss_final",
    "grad_norm",
    "kl",
    "entropy",
    "clip_low",
    "clip_high",
    "clip_region",
)

CFG = LlamaConfig(
    vocab_size=VOCAB, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64, max_len=S,
    compute_dtype="float32",
)  # fmt: skip
CASES = {
    # loss type, ratio level, LoRA
    "dapo-token": ("dapo", "token", False),
    "bnpo-sequence": ("bnpo", "sequence", False),  # GSPO's clip shares: a sequence mean
    "grpo-lora": ("grpo", "token", True),
}

# compiled updates of a model, four or five times each: minutes, not the fast tier's seconds
pytestmark = pytest.mark.slow


def hand_made_batch(seed: int, loss_type: str, k: int) -> dict[str, np.ndarray]:
    """N rows: a prompt of 3-6 tokens then a completion of 0-L tokens (row 5 empty), groups
    of G with random advantages, a reference's log-probabilities near the policy's."""
    rng = np.random.default_rng(seed)
    tokens = np.zeros((N, S), np.int32)
    mask = np.zeros((N, S), np.float32)
    for row in range(N):
        prompt = int(rng.integers(3, 7))
        completion = 0 if row == 5 else int(rng.integers(1, L + 1))
        tokens[row, : prompt + completion] = rng.integers(1, VOCAB, prompt + completion)
        mask[row, prompt : prompt + completion] = 1.0
    advantages = rng.normal(0.0, 1.0, N).astype(np.float32)
    return {
        "tokens": tokens,
        "mask": mask,
        "weights": token_weights(loss_type, mask, L, micro_batches=k),
        "advantages": advantages,
        "ref_logps": (np.log(1 / VOCAB) + rng.normal(0.0, 0.3, (N, S))).astype(np.float32),
    }


def _training() -> dict:
    training = {**schemas.defaults(schemas.TRAINING), "learning_rate": 3e-3, "warmup_steps": 0}
    training["eps"] = 1e-4  # see the module docstring: no amplified rounding noise
    return training


def _run(case: str, k: int, weights_k: int) -> dict:
    """UPDATES updates with ``grad_accum_steps`` k, bnpo's weights split into ``weights_k``."""
    loss_type, level, with_lora = CASES[case]
    steps = UPDATES * MU
    schedule = optimizer.make_schedule(_training(), steps)
    tx = optimizer.make_optimizer(_training(), steps, schedule)
    settings = objective.LossSettings(
        beta=BETA, epsilon=0.2, epsilon_high=0.28, importance_sampling_level=level
    )
    adapters = None
    base = model.init_params(CFG, jax.random.key(1))
    if with_lora:
        adapters = lora.LoraSettings(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "down_proj"))
        state = lora.init_state(CFG, adapters, tx, seed=3, identity=np.zeros(32, np.uint8))
    else:
        state = train_step.init_train_state(CFG, tx, seed=3)
    fn = grpo_update.make_update(
        CFG, tx, schedule, settings, MU, TEMPERATURE, adapters, accum_steps=k
    )
    step = jax.jit(fn)
    out = {"metrics": [], "logps": [], "start": state["params"]}
    for n in range(UPDATES):
        made = hand_made_batch(n, loss_type, weights_k)
        batch = Batch(**{name: jnp.asarray(v) for name, v in made.items()})
        # LoRA's update takes the frozen base between the state and the batch
        state, metrics, logps = step(state, base, batch) if with_lora else step(state, batch)
        out["metrics"].append({name: float(v) for name, v in metrics.items()})
        out["logps"].append(np.asarray(logps))
    out["params"] = state["params"]
    out["step"] = int(state["step"])
    return out


def _leaves(tree) -> list[np.ndarray]:
    return [np.asarray(x, np.float64) for x in jax.tree_util.tree_leaves(tree)]


def params_difference(a, b) -> float:
    """max |a − b| over every parameter, relative to the largest |a| of the whole tree (the
    parameters' scale: LoRA's B starts at 0, so an array's own scale can be far smaller)."""
    x, y = _leaves(a), _leaves(b)
    scale = max(float(np.max(np.abs(leaf))) for leaf in x)
    return max(float(np.max(np.abs(p - q))) for p, q in zip(x, y, strict=True)) / scale


@pytest.fixture(scope="module")
def runs():
    return {}


def _get(runs, case, k, weights_k):
    key = (case, k, weights_k)
    if key not in runs:
        runs[key] = _run(case, k, weights_k)
    return runs[key]


@pytest.mark.parametrize("case", list(CASES))
def test_two_micro_batches_are_the_update_of_one_batch(runs, case):
    micro = 2 if CASES[case][0] == "bnpo" else 1  # bnpo: the same weights both ways
    one, two = _get(runs, case, 1, micro), _get(runs, case, 2, micro)
    assert one["step"] == two["step"] == UPDATES
    # the update's first loss and its metrics (the same parameters before it)
    first_one, first_two = one["metrics"][0], two["metrics"][0]
    for name in METRICS:
        assert first_two[name] == pytest.approx(first_one[name], rel=FIRST_RTOL, abs=1e-7), name
    # later updates start from parameters that differ by rounding: a slightly wider margin
    for a, b in zip(one["metrics"], two["metrics"], strict=True):
        for name in METRICS:
            assert b[name] == pytest.approx(a[name], rel=1e-4, abs=1e-6), name
    # iteration 1's log-probabilities, back in row order (the rollouts file reads them so)
    for a, b in zip(one["logps"], two["logps"], strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
    # the clip shares are exercised (iteration 2 moved off ratio 1; LoRA's adapters start at
    # B = 0 and move too little for it), kl and entropy too
    if not CASES[case][2]:
        assert max(m["clip_region"] for m in one["metrics"]) > 0
    assert min(m["kl"] for m in one["metrics"]) > 0 and first_one["entropy"] > 0
    # they trained, by far more than the tolerance, to the same parameters
    assert params_difference(one["start"], one["params"]) > 100 * PARAM_RTOL
    assert params_difference(one["params"], two["params"]) <= PARAM_RTOL


def test_four_micro_batches_too(runs):
    one, four = _get(runs, "dapo-token", 1, 1), _get(runs, "dapo-token", 4, 1)
    for name in METRICS:
        assert four["metrics"][0][name] == pytest.approx(
            one["metrics"][0][name], rel=FIRST_RTOL, abs=1e-7
        ), name
    assert params_difference(one["params"], four["params"]) <= PARAM_RTOL


@pytest.mark.parametrize("k", [2, 4])
def test_bnpo_weights_normalise_each_micro_batch_the_update_accumulates(k):
    """Each micro-batch the update forms (``train_step.micro_batches``: every k-th row) holds
    token weights summing to 1/k (its token mean, then the mean over k), and its loss at ratio
    1 is its own token mean over k: TRL's bnpo per accumulation step."""
    batch = hand_made_batch(7, "bnpo", k)
    micro = train_step.micro_batches(batch, k)
    for m in range(k):
        mask, weights = micro["mask"][m], micro["weights"][m]
        assert mask.sum() > 0
        assert float(weights.sum()) == pytest.approx(1 / k, rel=1e-6)
        np.testing.assert_allclose(weights, mask / (mask.sum() * k), rtol=1e-6)


def test_bnpo_loss_is_the_mean_of_the_micro_batches_token_means(runs):
    """Iteration 1's loss of the k = 2 update, by hand from its returned log-probabilities:
    ratio 1, so each token's loss is −A + β·k3; the token mean of rows 0, 2, 4, 6 and of rows
    1, 3, 5, 7, then their mean."""
    two = _get(runs, "bnpo-sequence", 2, 2)
    batch = hand_made_batch(0, "bnpo", 2)
    logps = two["logps"][0].astype(np.float64)
    d = batch["ref_logps"].astype(np.float64) - logps
    per_token = -batch["advantages"][:, None].astype(np.float64) + BETA * (np.expm1(d) - d)
    means = []
    for m in range(2):
        mask = batch["mask"][m::2].astype(np.float64)
        means.append((per_token[m::2] * mask).sum() / mask.sum())
    assert two["metrics"][0]["loss"] == pytest.approx(np.mean(means), rel=1e-5)
    # the update's token mean (dapo's, bnpo with one micro-batch) is another value: the split
    # matters for bnpo
    mask = batch["mask"].astype(np.float64)
    assert np.mean(means) != pytest.approx((per_token * mask).sum() / mask.sum(), rel=1e-3)
