"""The preference strategy's recipe settings: its identity, the ``preference`` section's one
spelling per computation, and the cross-field checks its schema cannot express.

Keys of the ``preference`` section have no schema defaults: the value an absent key means
(the schema's ``x-absent``) is filled in here for the keys the chosen loss reads, and a key
the loss does not read is refused, so two recipes of one computation have one digest. This
module does not import JAX.
"""

from __future__ import annotations

from ... import schemas
from ..lm import model_section as sft_settings

NAME, VERSION = "preference", "1.0.0"
LOSSES = ("dpo", "ipo", "simpo", "orpo")
#: the losses that read the reference model's log-probabilities
WITH_REFERENCE = ("dpo", "ipo")
SCHEMA_FILE = "strategy-preference.schema.json"
SPLITS = ("train", "dev", "test")
#: the keys each loss reads (besides ``loss``)
LOSS_KEYS = {
    "dpo": ("beta", "label_smoothing", "reference", "rpo_alpha"),
    "ipo": ("beta", "reference", "rpo_alpha"),
    "simpo": ("beta", "gamma"),
    "orpo": ("orpo_lambda",),
}
assert set(LOSS_KEYS) == set(LOSSES)


def absent_values(section: str) -> dict:
    return schemas.absent(SCHEMA_FILE, section)


def normalize_preference(recipe: dict) -> list[dict]:
    """Fill in what absent keys mean for the loss's keys, refuse the others; returns errors."""
    section = recipe["preference"]
    loss = section["loss"]
    errors = [
        {
            "path": f"/preference/{key}",
            "message": f"not read by loss {loss} (only by "
            f"{', '.join(name for name, keys in LOSS_KEYS.items() if key in keys)})",
        }
        for key in sorted(section)
        if key != "loss" and key not in LOSS_KEYS[loss]
    ]
    absent = absent_values("preference")
    # rpo_alpha 0 is the plain loss: spelled by its absence, so recipes written before the key
    # existed keep their digests
    if section.get("rpo_alpha") == absent["rpo_alpha"]:
        section.pop("rpo_alpha")
    for key in LOSS_KEYS[loss]:
        if key in absent and key != "rpo_alpha":
            section.setdefault(key, absent[key])
            section[key] = float(section[key])
    if "rpo_alpha" in section:
        section["rpo_alpha"] = float(section["rpo_alpha"])
    if loss in WITH_REFERENCE and "reference" not in section:
        errors.append(
            {
                "path": "/preference/reference",
                "message": f"loss {loss} needs the reference model's log-probabilities: name the "
                "pinned input holding them (minifield reference-logprobs writes it)",
            }
        )
    evaluation = recipe["evaluation"]
    if evaluation.get("min_dev_reward_accuracy") == absent_values("evaluation").get(
        "min_dev_reward_accuracy"
    ):
        evaluation.pop("min_dev_reward_accuracy")
    if "min_dev_reward_accuracy" in evaluation and loss not in WITH_REFERENCE:
        errors.append(
            {
                "path": "/evaluation/min_dev_reward_accuracy",
                "message": f"only for dpo and ipo (loss {loss} has no reference model)",
            }
        )
    return errors


def wanted_inputs(recipe: dict) -> list[str]:
    """The pinned inputs the recipe needs: the splits, the base model's files and, for
    DPO/IPO, the reference log-probabilities."""
    names = [*SPLITS, *sft_settings.base_model_inputs(recipe["model"])]
    if "reference" in recipe["preference"]:
        names.append(recipe["preference"]["reference"])
    return names


def single_device_errors(training: dict) -> list[dict]:
    """What this version does not run: data parallelism, gradient accumulation."""
    errors = []
    if training["data_parallel"]["devices"] != 1:
        errors.append(
            {
                "path": "/training/data_parallel/devices",
                "message": "preference 1.0.0 runs on one device (must be 1)",
            }
        )
    if training.get("grad_accum_steps", 1) != 1:
        errors.append(
            {
                "path": "/training/grad_accum_steps",
                "message": "preference 1.0.0 has no gradient accumulation (must be 1 or absent)",
            }
        )
    else:
        training.pop("grad_accum_steps", None)
    return errors
