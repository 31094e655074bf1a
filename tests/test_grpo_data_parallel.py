"""grpo with data parallelism and gradient accumulation, through the real worker on CPU with
forced host devices (``XLA_FLAGS=--xla_force_host_platform_device_count=N``): the mathematics
of one device.

Three runs of one recipe (full fine-tuning, a reference and its k3 KL, μ = 2, the demo base):
one device; two devices (the state replicated); two devices with the parameters sharded and
two micro-batches per optimizer step, this one crashed after update 3 and resumed (its two
attempts are the run the first two checks read: one worker run serves the crash check and
the comparison with one device). And the same recipe with LoRA (the reference: the frozen
base with the adapters left out) on one device and on two with the frozen base sharded,
as packed-sft runs LoRA on a mesh. On the mesh the rollouts are generated with each device
decoding its own rows, the reference's log-probabilities and the update run with the rows
split over ``data``; rewards and advantages are computed on the host over the whole update.

- Every update's rollouts are the same tokens: each row's draws are keyed by (seed, update,
  prompt, completion), whatever device decodes it. Update 1 starts from the same parameters,
  so its sampling logits agree to rounding and every draw is the same; later updates too
  (a token drawn otherwise would move the loss by far more than the tolerance below).
- Losses, the rollouts files' log-probabilities and the exported parameters agree within FP32
  rounding: partial sums formed per device and per micro-batch are another order of FP32
  additions, nothing else. Tolerances (:data:`LOSS_RTOL`, :data:`LOGP_ATOL`,
  :data:`PARAM_RTOL`) with the figures measured here in their comments.
- Each is its own computation (another digest, other bits).

Bad inputs are refused at validation, naming the field.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import (
    attempts_of,
    read_events,
    run_attempt,
    started_xla_flags,
    update_hashes,
    write_recipe,
)
from grpo_cases import make_inputs, recipe
from safetensors.numpy import load_file

import minifield

#: absolute difference of an update's losses: the loss is Σ w·(−A + β·k3) over terms of order
#: 1 that mostly cancel (the advantages of a group sum to 0), so its rounding is absolute, of
#: the terms' scale. Update 1's ``loss`` (the same parameters; measured 3.5e-8, 0 on two
#: devices without accumulation), every other loss (parameters that differ by rounding;
#: ``loss_final`` after an optimizer step, measured 1.5e-6)
FIRST_LOSS_ATOL, LOSS_ATOL = 1e-6, 1e-5
#: relative difference of the kl and entropy metrics (measured 2.6e-6)
METRIC_RTOL = 1e-5
#: absolute difference of a rollouts file's log-probabilities: update 1 (the same
#: parameters; measured 1.9e-6), later updates (parameters that differ by rounding, through
#: a policy sampled at temperature 2.5; measured 2.7e-5)
FIRST_LOGP_ATOL, LOGP_ATOL = 1e-5, 1e-4
#: max |Δ| of the exported parameters relative to the largest parameter (measured: 6e-7)
PARAM_RTOL = 1e-5
UPDATES = 3
RUNS = {
    "one": {"devices": 1},
    "two": {"devices": 2},
    "two-sharded-accum": {"devices": 2, "shard_params": True, "grad_accum_steps": 2},
    "one-lora": {"devices": 1, "lora": True},
    "two-lora": {"devices": 2, "shard_params": True, "lora": True},
}
#: each run on the mesh and the one-device run it is the mathematics of
PAIRS = {"two": "one", "two-sharded-accum": "one", "two-lora": "one-lora"}
LORA = {"rank": 4, "alpha": 8, "targets": ["q_proj", "v_proj", "down_proj"]}


def devices_env(count: int) -> dict:
    """CPU only, with ``count`` host devices (no forced count for one device), compiled with
    the session's light flags like every process the suite starts: every run these tests
    compare to the bit is started through here, so all compile alike."""
    forced = [f"--xla_force_host_platform_device_count={count}"] if count > 1 else []
    return {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": started_xla_flags(*forced)}


def dp_recipe(
    root, devices: int = 1, shard_params: bool = False, grad_accum_steps: int = 1, lora=False
):
    raw = recipe(
        root,
        {"temperature": 2.5, "beta": 0.04, "num_iterations": 2},
        # eps: AdamW's 1e-8 turns rounding in near-zero gradient entries into parameter
        # differences up to the learning rate (tests/test_grad_accum.py); 1e-4 does not
        training={
            "data_parallel": {"devices": devices, "shard_params": shard_params},
            "eps": 1e-4,
        },
        limits={"max_steps": UPDATES},
        checkpoint={"every_steps": 2, "keep": 2},
    )
    if grad_accum_steps != 1:
        raw["training"]["grad_accum_steps"] = grad_accum_steps
    if lora:
        raw["model"]["lora"] = dict(LORA)
    return raw


@pytest.fixture(scope="module")
def space(tmp_path_factory):
    top = tmp_path_factory.mktemp("grpo-dp")
    return {"top": top, "root": make_inputs(top / "in"), "cache": top / "jax-cache"}


#: the run that is crashed after update 3 and resumed (as one chain of attempts, it serves the
#: comparison with one device too: each run is one worker process fewer)
CRASHED = "two-sharded-accum"


@pytest.fixture(scope="module")
def runs(space) -> dict:
    """Each run's chain of attempts (oldest first) and recipe. :data:`CRASHED` is run as a
    crash after update 3 (sharded parameters, two micro-batches, two devices) and its resume
    from the step-2 checkpoint, placed on the mesh again; the others run uninterrupted."""
    out = {}
    for name, settings in RUNS.items():
        path = write_recipe(space["top"] / f"{name}.json", dp_recipe(space["root"], **settings))
        env = devices_env(settings["devices"])
        if name == CRASHED:
            run_attempt(path, space["root"], space["top"] / name, "--fail-after-step", "3",
                        codes=(1,), env=env, cache=space["cache"])  # fmt: skip
            (crashed,) = attempts_of(space["top"] / name, "grpo-test")
            run_attempt(path, space["root"], space["top"] / name, "--resume-from", crashed,
                        env=env, cache=space["cache"])  # fmt: skip
        else:
            run_attempt(path, space["root"], space["top"] / name, env=env, cache=space["cache"])
        out[name] = attempts_of(space["top"] / name, "grpo-test")
        assert len(out[name]) == (2 if name == CRASHED else 1)
        out[f"{name}-recipe"] = path
    return out


def _updates(chain) -> list[dict]:
    """The update events over a chain of attempts (a later attempt's update replaces one an
    interrupted attempt made), in step order."""
    found = {}
    for attempt in chain:
        for event in read_events(attempt / "events.jsonl"):
            if event["type"] == "update":
                found[event["step"]] = event
    return [found[step] for step in sorted(found)]


def _rollouts(chain, update: int) -> list[dict]:
    """One update's rollouts file, from the last attempt of ``chain`` that wrote it."""
    path = next(
        attempt / "rollouts" / f"update-{update:08d}.jsonl"
        for attempt in reversed(chain)
        if (attempt / "rollouts" / f"update-{update:08d}.jsonl").is_file()
    )
    return [json.loads(line) for line in path.read_text().splitlines()]


def _params(chain) -> dict[str, np.ndarray]:
    return load_file(str(chain[-1] / "export" / "model.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PAIRS))
def test_two_devices_are_the_mathematics_of_one(runs, name):
    one, other = runs[PAIRS[name]], runs[name]
    # the same rollouts: every row's tokens, rewards and advantages
    for update in range(1, UPDATES + 1):
        a, b = _rollouts(one, update), _rollouts(other, update)
        assert len(a) == len(b) == 8
        for x, y in zip(a, b, strict=True):
            for key in ("prompt_index", "completion_index", "prompt_ids", "completion_ids"):
                assert x[key] == y[key], (update, x["row"], key)
            assert x["total"] == y["total"] and x["advantage"] == y["advantage"]
            atol = FIRST_LOGP_ATOL if update == 1 else LOGP_ATOL
            np.testing.assert_allclose(y["logps"], x["logps"], rtol=0, atol=atol)
            np.testing.assert_allclose(y["ref_logps"], x["ref_logps"], rtol=0, atol=atol)
    # each update's losses and metrics within FP32 rounding
    ua, ub = _updates(one), _updates(other)
    assert [e["step"] for e in ua] == [e["step"] for e in ub] == list(range(1, UPDATES + 1))
    assert ub[0]["loss"] == pytest.approx(ua[0]["loss"], rel=0, abs=FIRST_LOSS_ATOL)
    for ea, eb in zip(ua, ub, strict=True):
        for key in ("loss", "loss_final"):
            assert eb[key] == pytest.approx(ea[key], rel=0, abs=LOSS_ATOL), (ea["step"], key)
        for key in ("kl", "entropy", "reward", "loss_tokens"):
            assert eb[key] == pytest.approx(ea[key], rel=METRIC_RTOL, abs=1e-7), (ea["step"], key)
        for key in ("clip_low", "clip_high", "clip_region"):
            assert eb[key] == pytest.approx(ea[key], abs=1e-6), (ea["step"], key)
    assert any(e["reward_std"] > 0 for e in ua)  # the advantages were not all 0
    # the exported parameters: they moved, by far more than the tolerance, to the same place
    pa, pb = _params(one), _params(other)
    assert sorted(pa) == sorted(pb)
    scale = max(float(np.abs(v).max()) for v in pa.values())
    difference = max(float(np.abs(pa[k] - pb[k]).max()) for k in pa)
    assert difference <= PARAM_RTOL * scale, difference / scale
    base = load_file(str(one[0].parent.parent.parent / "in" / "base" / "model.safetensors"))
    moved = max(float(np.abs(pa[k] - base[k]).max()) for k in pa if k in base)
    assert moved > 100 * PARAM_RTOL * scale
    # another computation: another digest, other bits; on the mesh it says where it ran
    result_a = json.loads((one[-1] / "result.json").read_text())
    result_b = json.loads((other[-1] / "result.json").read_text())
    assert result_a["computation_digest"] != result_b["computation_digest"]
    assert result_a["final_state_hash"] != result_b["final_state_hash"]
    events = read_events(other[-1] / "events.jsonl")  # where the last attempt ran
    device = next(e for e in events if e["type"] == "device")
    assert device["data_parallel_devices"] == 2 and device["device_count"] == 2
    placement = next(e for e in events if e["type"] == "compiled")["placement"]
    assert placement["devices"] == 2
    assert (placement["sharded_arrays"] > 0) == RUNS[name].get("shard_params", False)
    # DEV evaluation (greedy, rows split over the mesh) selects the same
    assert result_b["metrics"]["dev_reward"] == pytest.approx(result_a["metrics"]["dev_reward"])


@pytest.mark.parametrize(
    ("settings", "path", "words"),
    [
        ({"devices": 3}, "/training/data_parallel/devices", "must divide training.batch_size=8"),
        ({"grad_accum_steps": 3}, "/training/grad_accum_steps", "multiple of devices x"),
        ({"devices": 2, "grad_accum_steps": 8}, "/training/grad_accum_steps", "= 16 (got 8)"),
        ({"devices": 4, "grad_accum_steps": 4}, "/training/grad_accum_steps", "= 16 (got 4)"),
    ],
)
def test_rows_that_do_not_split_are_refused_naming_the_field(space, settings, path, words):
    checked = minifield.validate(dp_recipe(space["root"], **settings))
    assert not checked.valid
    errors = {e["path"]: e["message"] for e in checked.errors}
    assert list(errors) == [path], errors
    assert words in errors[path], errors


def test_splits_that_fit_validate_and_are_other_computations(space):
    digests = set()
    for settings in [{}, {"devices": 2}, {"devices": 2, "grad_accum_steps": 2},
                     {"devices": 4, "shard_params": True}, {"grad_accum_steps": 8}]:  # fmt: skip
        checked = minifield.validate(dp_recipe(space["root"], **settings))
        assert checked.valid, (settings, checked.errors)
        loaded = checked.recipe
        assert loaded.strategy.devices_required(loaded.data) == settings.get("devices", 1)
        digests.add(checked.computation_digest)
    assert len(digests) == 5
    # absent and 1 are one spelling of one micro-batch
    spelled = dp_recipe(space["root"])
    spelled["training"]["grad_accum_steps"] = 1
    assert (
        minifield.validate(spelled).computation_digest
        == minifield.validate(dp_recipe(space["root"])).computation_digest
    )


@pytest.mark.slow
def test_a_crash_on_the_mesh_resumes_to_the_same_bits(runs):
    """Sharded parameters and two micro-batches on two devices: a crash after update 3,
    resumed from the step-2 checkpoint (placed on the mesh again), recomputes update 3 to the
    state hash and rollouts file the crashed attempt made of it uninterrupted (updates 1 to 3
    in one process, then the crash)."""
    crashed, resumed = runs[CRASHED]
    info = json.loads((resumed / "attempt.json").read_text())
    assert Path(info["resumed_from"]) == crashed.resolve()
    (restored,) = [e for e in read_events(resumed / "events.jsonl") if e["type"] == "restored"]
    assert restored["step"] == 2  # the checkpoint before the crash
    hashes = {a: update_hashes([a]) for a in (crashed, resumed)}
    assert sorted(hashes[crashed]) == [1, 2, 3] and sorted(hashes[resumed]) == [3]
    assert hashes[resumed][3] == hashes[crashed][3]
    name = "update-00000003.jsonl"
    assert (resumed / "rollouts" / name).read_bytes() == (crashed / "rollouts" / name).read_bytes()
