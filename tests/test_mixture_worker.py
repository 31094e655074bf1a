"""A weighted mixture with gradient accumulation through the real worker: SIGKILL and resume
are bit-identical, the summary says what each source trained, and accumulation runs under
data parallelism (two forced host devices).

Tolerance of the data-parallel check (as in test_data_parallel.py): the accumulated and the
plain update of the same rows differ only in the order of FP32 additions; update 1 starts
from identical parameters, so its loss agrees to relative 1e-6 (it is a forward pass: the
micro-batches change nothing in it but the order of the final sum), and later updates to
relative 1e-3, the AdamW amplification test_data_parallel.py measures, still far below the
loss's change per update.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import (
    attempts_of,
    read_events,
    run_attempt,
    started_xla_flags,
    worker_command,
    write_recipe,
)
from recovery_cases import attempt_options, run_and_kill, update_hashes
from test_mixtures import mixed_recipe, mixture_inputs

from minifield.data import encoding, packing
from minifield.data import tokenizer as tokenizers
from minifield.observe import summarize

pytestmark = pytest.mark.slow

STEPS, EVERY, KILL_AT = 6, 2, 4  # SIGKILL once the checkpoint of update 4 is durable


def two_devices() -> dict:
    """Two forced host devices, compiled with the session's light flags as every started
    process is (the two runs compared are both started so)."""
    flags = started_xla_flags("--xla_force_host_platform_device_count=2")
    return {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags}


@pytest.fixture(scope="module")
def space(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("mixture-worker")
    return {"root": root, "cache": root / "jax-cache", **mixture_inputs(root)}


@pytest.fixture(scope="module")
def recipe_path(space):
    recipe = mixed_recipe(space, grad_accum_steps=2)
    recipe["limits"], recipe["checkpoint"] = {"max_steps": STEPS}, {"every_steps": EVERY, "keep": 3}
    recipe["evaluation"]["max_generate_examples"] = 0  # no greedy generation: not the point
    return write_recipe(space["root"] / "mix.json", recipe)


@pytest.fixture(scope="module")
def reference(space, recipe_path):
    out = space["root"] / "reference"
    run_attempt(recipe_path, space["input_root"], out, cache=space["cache"])
    (attempt,) = attempts_of(out, "mix")
    return attempt


def test_kill_and_resume_with_a_mixture_is_bit_identical(space, recipe_path, reference):
    out = space["root"] / "killed"
    options = attempt_options(recipe_path, space["input_root"], out, "killed")
    outcome = run_and_kill(
        worker_command(**options, compilation_cache=space["cache"]),
        lambda e: e["type"] == "checkpoint_committed" and e["step"] == KILL_AT,
    )
    assert outcome["killed_after"] is not None, outcome["events_seen"][-3:]
    killed = out / "mix" / "killed"
    run_attempt(
        recipe_path, space["input_root"], out, "--resume-from", killed, cache=space["cache"]
    )
    resumed = next(a for a in attempts_of(out, "mix") if a != killed)
    restored = [e for e in read_events(resumed / "events.jsonl") if e["type"] == "restored"]
    assert restored and restored[0]["step"] == KILL_AT
    expected = update_hashes(reference)
    assert sorted(expected) == list(range(1, STEPS + 1))
    before, after = update_hashes(killed), update_hashes(resumed)
    assert {s: expected[s] for s in before} == before  # the killed run's, lost ones included
    assert {s: expected[s] for s in after} == after and max(after) == STEPS
    final = [json.loads((a / "result.json").read_text()) for a in (reference, resumed)]
    assert final[0]["final_state_hash"] == final[1]["final_state_hash"]

    # the summary of the two attempts: what the final state trained on, per source
    chain = summarize.summarize([killed / "events.jsonl", resumed / "events.jsonl"])
    assert chain["sources"] == summarize.summarize([reference / "events.jsonl"])["sources"]
    rows = {name: figures["trained_rows_count"] for name, figures in chain["sources"].items()}
    assert sum(rows.values()) == STEPS * 8  # every row of every update once, redone ones once
    byte = tokenizers.byte_tokenizer()
    for name, figures in chain["sources"].items():
        examples = encoding.encode_file(space["input_root"] / "sft" / f"{name}.jsonl", byte)
        n_rows = packing.pack(examples, 32, "truncate", byte.pad_id).stats["rows"]
        assert figures["epochs_count"] == pytest.approx(rows[name] / n_rows)
        assert 0 < figures["trained_loss_tokens_count"] <= rows[name] * 32


def test_accumulation_under_data_parallelism_matches_the_plain_update(space):
    curves = {}
    for accum in (1, 2):
        recipe = mixed_recipe(space, devices=2, grad_accum_steps=accum)
        recipe["model"]["compute_dtype"] = "float32"
        recipe["evaluation"]["max_generate_examples"] = 0
        path = write_recipe(space["root"] / f"dp-{accum}.json", recipe)
        out = space["root"] / f"dp-{accum}"
        run_attempt(path, space["input_root"], out, cache=space["cache"], env=two_devices())
        (attempt,) = attempts_of(out, "mix")
        events = read_events(attempt / "events.jsonl")
        compiled = next(e for e in events if e["type"] == "compiled")
        assert compiled["placement"]["devices"] == 2, compiled
        curves[accum] = np.array([e["loss"] for e in events if e["type"] == "update"])
    assert len(curves[1]) == len(curves[2]) == 6
    np.testing.assert_allclose(curves[2][0], curves[1][0], rtol=1e-6)
    np.testing.assert_allclose(curves[2], curves[1], rtol=1e-3)
