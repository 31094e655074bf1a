"""The preference program in process: each update's pairs (whole, each pair in one row, an
epoch covering every pair once), and the first update's metrics against the pairs' answers
scored by the float64 NumPy forward and the SimPO/ORPO formulas written here, for full
fine-tuning and LoRA (whose adapters start at zero, so both start from the base)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from family_reference import reference_logits
from preference_cases import BASE_DIR, make_inputs, recipe
from safetensors.numpy import load_file

from minifield import recipe as recipes
from minifield.inputs import pinned
from minifield.strategies.preference import pairs

LORA = {"rank": 4, "alpha": 8.0, "targets": ["q_proj", "v_proj"]}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return make_inputs(tmp_path_factory.mktemp("prog") / "in")


def _program(root, preference, **sections):
    loaded = recipes.validate(recipe(root, preference, **sections))
    arrays, _ = loaded.strategy.prepare(loaded.data, pinned.files_by_name(loaded.data, root))
    return loaded, arrays, loaded.strategy.build(loaded.data, arrays)


def _numpy_logp(prompt, answer):
    hf = json.loads((BASE_DIR / "config.json").read_text())
    ids = prompt + answer
    logits = reference_logits(load_file(BASE_DIR / "model.safetensors"), hf, ids)
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    return sum(logp[t - 1, ids[t]] for t in range(len(prompt), len(ids)))


def test_every_update_holds_batch_size_whole_pairs_and_an_epoch_covers_each_once(root):
    _, arrays, program = _program(root, {"loss": "simpo"}, limits={"max_steps": 12})
    batches, n = program.batches, int(arrays["train_pairs"])
    per_epoch = n // batches.batch_size  # 24 pairs, 4 per update: 6 updates an epoch
    seen = []
    for step in range(per_epoch):
        batch = batches.batch(step)
        ids = batch.pair_index[batch.pair_index >= 0]
        assert len(ids) == batches.batch_size
        assert batch.tokens.shape[0] == batches.rows
        for row, slot in zip(*np.nonzero(batch.pair_index >= 0), strict=True):
            for segment in (2 * slot + 1, 2 * slot + 2):  # both answers in this row
                assert np.any(batch.segments[row] == segment)
        seen += ids.tolist()
    assert sorted(seen) == list(range(n))


@pytest.mark.parametrize(
    ("preference", "model"),
    [
        ({"loss": "simpo", "beta": 2.0, "gamma": 0.5}, {}),
        pytest.param({"loss": "orpo", "orpo_lambda": 0.5}, {"lora": LORA}, marks=pytest.mark.slow),
    ],
    ids=["simpo-full", "orpo-lora"],
)
def test_the_first_update_reports_the_loss_of_its_pairs_scored_by_numpy(root, preference, model):
    loaded, arrays, program = _program(root, preference, model=model)
    batch = program.batches.batch(0)
    files = pinned.files_by_name(loaded.data, root)
    from minifield.hf import pinned_base

    encoded = pairs.encode(
        pairs.read(files["train"]), *pinned_base.tokenizer_from_arrays(loaded.data, arrays)
    )
    ids = batch.pair_index[batch.pair_index >= 0]
    chosen = np.array([_numpy_logp(encoded[i].prompt, encoded[i].chosen) for i in ids])
    rejected = np.array([_numpy_logp(encoded[i].prompt, encoded[i].rejected) for i in ids])
    n_c = np.array([len(encoded[i].chosen) for i in ids], float)
    n_r = np.array([len(encoded[i].rejected) for i in ids], float)
    a, b = chosen / n_c, rejected / n_r
    if preference["loss"] == "simpo":
        beta, gamma = preference["beta"], preference["gamma"]
        z = beta * a - beta * b - gamma
        want = np.mean(np.log1p(np.exp(-z)))
        rewards = (beta * a, beta * b)
    else:  # ORPO: -a + λ·-log σ(log odds(a) - log odds(b)), odds p/(1-p) of p = e^a
        ratio = np.log(np.exp(a) / (1 - np.exp(a))) - np.log(np.exp(b) / (1 - np.exp(b)))
        want = np.mean(-a + preference["orpo_lambda"] * np.log1p(np.exp(-ratio)))
        rewards = (a, b)
    state = program.place(program.init_state())
    _, metrics = program.step(state)
    assert metrics["loss"] == pytest.approx(want, abs=1e-4)
    assert metrics["pairs"] == len(ids) == metrics["examples"]
    assert metrics["chosen_logps"] == pytest.approx(chosen.mean(), abs=1e-4)
    assert metrics["rejected_logps"] == pytest.approx(rejected.mean(), abs=1e-4)
    assert metrics["reward_accuracy"] == pytest.approx(np.mean(rewards[0] > rewards[1]))
    assert metrics["margin"] == pytest.approx(np.mean(rewards[0] - rewards[1]), abs=1e-4)
    assert metrics["loss_tokens"] == n_c.sum() + n_r.sum()
    assert np.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0
