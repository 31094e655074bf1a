"""Preference runs split over devices and micro-batches, in process: a few updates of the real
program on the demo base (tests/preference_cases.py), their metrics and final parameters.

Run as a script (``python tests/preference_mesh_cases.py ROOT OUT``, with
``XLA_FLAGS=--xla_force_host_platform_device_count=2``) it makes the runs of
tests/test_preference_data_parallel.py: the reference log-probabilities on the mesh
(replicated and sharded) and on one device, every loss's runs on two devices and on one,
written under ``OUT``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from preference_cases import make_inputs, near_miss, recipe, with_reference  # noqa: E402

UPDATES = 2
#: each loss's settings: beta large enough that the preference term moves the parameters
LOSSES = {
    "dpo": {"loss": "dpo", "beta": 0.5, "label_smoothing": 0.1, "rpo_alpha": 0.5},
    "ipo": {"loss": "ipo", "beta": 0.5},
    "simpo": {"loss": "simpo", "beta": 2.0, "gamma": 0.5},
    "orpo": {"loss": "orpo", "orpo_lambda": 0.5},
}
#: the update's metrics compared
METRICS = ("loss", "reward_accuracy", "margin", "chosen_logps", "rejected_logps", "grad_norm")
#: relative and absolute tolerance of the metrics: other orders of FP32 additions in sums of
#: log-probabilities of magnitude up to ~50 (measured: relative 9e-6 at most, IPO's update-1
#: grad_norm on the sharded mesh; absolute 7e-6 at most for values near 0, the DPO/IPO
#: margins of update 1)
METRIC_RTOL, METRIC_ATOL = 2e-5, 2e-5
#: max |Δ| of the final parameters relative to the largest one (measured 1.1e-6; AdamW's eps
#: 1e-4, :func:`training`)
PARAM_RTOL = 1e-5
#: the runs on two devices: (data_parallel, grad_accum_steps)
MESH_RUNS = {
    "two": ({"devices": 2, "shard_params": False}, 1),
    "two-sharded-accum": ({"devices": 2, "shard_params": True}, 2),
}


def make_mesh_inputs(root: Path) -> Path:
    """tests/preference_cases.py's inputs with pairs whose answers are both wrong: the chosen
    one the reversed word with its last two letters swapped, the rejected one with its last
    letter doubled. The demo base gives each a summed log-probability of about −10 to −40,
    far from 0: near-certain answers (log-probabilities of −1e-5 formed as differences of
    logits of ~10) would have FP32 rounding of their own size, and ORPO's log-odds, whose
    derivative is 1/a there, would turn it into gradients that differ by far more than the
    rounding of the sums this test is about."""
    make_inputs(root)
    for split in ("train", "dev", "test"):
        path = root / "pairs" / f"{split}.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        for row in rows:
            good = row["chosen"]
            row["chosen"], row["rejected"] = near_miss(good), good + good[-1]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def training(data_parallel: dict | None = None, grad_accum_steps: int = 1) -> dict:
    """The recipes' training section: 4 pairs an update; AdamW's eps 1e-4, not 1e-8, so
    rounding in near-zero gradient entries is not amplified into parameter differences of
    the learning rate's size (tests/test_grad_accum.py)."""
    out = {"eps": 1e-4, "data_parallel": data_parallel or {"devices": 1, "shard_params": False}}
    if grad_accum_steps != 1:
        out["grad_accum_steps"] = grad_accum_steps
    return out


def reference_file(root: Path, data_parallel: dict | None = None) -> str:
    """The reference log-probabilities for ``data_parallel`` (one device: None), computed
    into ``root`` once; their path under ``root``."""
    from minifield import recipe as recipes
    from minifield.strategies.preference import reference

    name = "ref-1" if data_parallel is None else f"ref-{data_parallel['devices']}"
    if data_parallel and data_parallel["shard_params"]:
        name += "-sharded"
    if not (root / name / reference.DATA_FILE).is_file():
        document = recipe(root, {"loss": "simpo"}, training=training(data_parallel))
        reference.compute(recipes.validate(document), root, root / name)
    return f"{name}/{reference.DATA_FILE}"


def run(root: Path, loss: str, data_parallel: dict | None = None, grad_accum_steps: int = 1):
    """``(metrics per update, DEV metrics, final parameters by path)`` of ``UPDATES`` updates."""
    import jax

    from minifield import recipe as recipes
    from minifield.inputs import pinned
    from minifield.models.layers import layer_stack

    document = recipe(
        root,
        LOSSES[loss],
        training=training(data_parallel, grad_accum_steps),
        limits={"max_steps": UPDATES},
    )
    if loss in ("dpo", "ipo"):
        document = with_reference(document, root, reference_file(root, data_parallel))
    loaded = recipes.validate(document)
    arrays, _ = loaded.strategy.prepare(loaded.data, pinned.files_by_name(loaded.data, root))
    program = loaded.strategy.build(loaded.data, arrays)
    program.lay_out_mesh()
    state = program.init_state()
    metrics = []
    for _ in range(UPDATES):
        state, measured = program.step(state)
        metrics.append({k: measured[k] for k in (*METRICS, "pairs", "examples")})
    dev = program.evaluate(state)
    params = layer_stack.per_layer(state["params"])
    flat = {
        jax.tree_util.keystr(path): np.asarray(jax.device_get(leaf))
        for path, leaf in jax.tree_util.tree_leaves_with_path(params)
    }
    return metrics, dev, flat


def close_runs(loss: str, one, other) -> None:
    """Two runs' metrics, DEV metrics and final parameters within the tolerances above.

    DPO's and IPO's update 1 has the policy equal to the reference, so every reward margin is
    0 up to rounding (the policy's and the reference's sums come from different programs)
    and its ``reward_accuracy`` counts rounding's signs: left out."""
    (metrics_a, dev_a, params_a), (metrics_b, dev_b, params_b) = one, other
    for update, (a, b) in enumerate(zip(metrics_a, metrics_b, strict=True)):
        assert a["pairs"] == b["pairs"] and a["examples"] == b["examples"]
        for name in METRICS:
            if name == "reward_accuracy" and update == 0 and loss in ("dpo", "ipo"):
                continue
            np.testing.assert_allclose(
                b[name], a[name], rtol=METRIC_RTOL, atol=METRIC_ATOL, err_msg=f"{update} {name}"
            )
    assert dev_a.keys() == dev_b.keys()
    for name in dev_a:
        np.testing.assert_allclose(
            dev_b[name], dev_a[name], rtol=METRIC_RTOL, atol=METRIC_ATOL, err_msg=name
        )
    scale = max(float(np.max(np.abs(v))) for v in params_a.values())
    worst = max(float(np.max(np.abs(params_a[k] - params_b[k]))) for k in params_a)
    assert worst <= PARAM_RTOL * scale, (worst, scale)


def main(root: Path, out: Path) -> None:
    """The two-device runs and references under ``out`` (``runs.json``, ``{name}.npz``), and
    every loss's one-device run (``runs.json``'s ``one``, ``one-{loss}.npz``; the one-device
    reference file into ``root``): the same ``run`` with ``data_parallel`` None, in this
    process so that the test's own process compiles none of them."""
    import jax
    from safetensors.numpy import load_file

    assert len(jax.devices()) >= 2, jax.devices()
    out.mkdir(parents=True, exist_ok=True)
    record = {"reference": {}, "runs": {}, "one": {}}
    reference_file(root)
    for loss in LOSSES:
        metrics, dev, params = run(root, loss)
        record["one"][loss] = {"metrics": metrics, "dev": dev}
        np.savez(out / f"one-{loss}.npz", **params)
    for name, (data_parallel, _) in MESH_RUNS.items():
        path = reference_file(root, data_parallel)
        np.savez(out / f"reference-{name}.npz", **load_file(root / path))
        record["reference"][name] = path
    for loss in LOSSES:
        for name, (data_parallel, accum) in MESH_RUNS.items():
            metrics, dev, params = run(root, loss, data_parallel, accum)
            record["runs"][f"{loss}-{name}"] = {"metrics": metrics, "dev": dev}
            np.savez(out / f"{loss}-{name}.npz", **params)
    (out / "runs.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
