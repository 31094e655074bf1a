"""The grpo strategy's recipe settings: its identity, the ``rl`` section's one spelling per
computation, and the cross-field checks its schema cannot express.

Every key of ``rl`` has a schema default but ``epsilon_high``, whose absence means
``epsilon`` (filled in here), so two recipes of one computation have one digest. The rewards
are normalised by :func:`minifield.rl.rewards.normalize`. This module does not import JAX.
"""

from __future__ import annotations

from ...rl import rewards as reward_kinds
from ..lm import model_section

NAME, VERSION = "grpo", "1.0.0"
SPLITS = ("train", "dev", "test")
#: ``rl`` keys spelled as floats in the digest (YAML's 1 and 1.0 are one computation)
FLOAT_KEYS = ("temperature", "top_p", "beta", "epsilon", "epsilon_high")


def normalize_rl(recipe: dict) -> list[dict]:
    """Fill in what absent keys mean, check what the schema cannot; returns errors."""
    rl, training = recipe["rl"], recipe["training"]
    rl.setdefault("epsilon_high", rl["epsilon"])
    for key in FLOAT_KEYS:
        rl[key] = float(rl[key])
    names = [i["name"] for i in recipe.get("inputs", [])]
    errors = reward_kinds.normalize(rl["rewards"], names)
    G = rl["num_generations"]
    if training["batch_size"] % G:
        errors.append(
            {
                "path": "/training/batch_size",
                "message": f"counts the completions of one update: must be a multiple of "
                f"rl.num_generations={G} (got {training['batch_size']})",
            }
        )
    if rl["max_completion_length"] >= training["seq_len"]:
        errors.append(
            {
                "path": "/rl/max_completion_length",
                "message": f"must leave room for the prompt in training.seq_len="
                f"{training['seq_len']} (got {rl['max_completion_length']})",
            }
        )
    errors += _training_errors(training)
    if "max_dev_exact_match_drop" in recipe["evaluation"] and not exact_match_reward(recipe):
        errors.append(
            {
                "path": "/evaluation/max_dev_exact_match_drop",
                "message": "needs an exact_match reward in rl.rewards (DEV exact-match is its "
                "value)",
            }
        )
    return errors


def _training_errors(training: dict) -> list[dict]:
    """What the update's rows must split into: the devices of ``data_parallel`` and the
    micro-batches of ``grad_accum_steps`` (absent and 1 are one spelling); ``train_on``,
    ``mixture`` and ``allow_unknown_tokens`` are not read."""
    errors = []
    rows, devices = training["batch_size"], training["data_parallel"]["devices"]
    accum = training.get("grad_accum_steps", 1)
    if accum == 1:
        training.pop("grad_accum_steps", None)
    if rows % devices:
        errors.append(
            {
                "path": "/training/data_parallel/devices",
                "message": f"must divide training.batch_size={rows} (every device gets the same "
                f"number of completions; got {devices})",
            }
        )
    elif rows % (devices * accum):
        errors.append(
            {
                "path": "/training/grad_accum_steps",
                "message": f"must divide training.batch_size={rows} into micro-batches whose "
                f"completions split evenly over training.data_parallel.devices={devices}: "
                f"batch_size must be a multiple of devices x grad_accum_steps = "
                f"{devices * accum} (got {accum})",
            }
        )
    for key in ("train_on", "mixture", "allow_unknown_tokens"):
        if key in training:
            errors.append({"path": f"/training/{key}", "message": "not read by grpo"})
    return errors


def wanted_inputs(recipe: dict) -> list[str]:
    """The pinned inputs the recipe needs: the splits, the base model's files and each
    Python reward's file."""
    names = [*SPLITS, *model_section.base_model_inputs(recipe["model"])]
    return names + [f for f in python_reward_inputs(recipe) if f not in names]


def python_reward_inputs(recipe: dict) -> list[str]:
    """The pinned inputs holding the recipe's Python reward functions."""
    return sorted({r["file"] for r in recipe["rl"]["rewards"] if r["kind"] == "python"})


def exact_match_reward(recipe: dict) -> str | None:
    """The name of the recipe's first exact_match reward (DEV exact-match), or None."""
    for reward in recipe["rl"]["rewards"]:
        if reward["kind"] == "exact_match":
            return reward["name"]
    return None
