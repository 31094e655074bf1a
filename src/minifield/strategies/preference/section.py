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
SCHEMA_FILE = schemas.strategy_file(NAME)
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


def split_errors(training: dict) -> list[dict]:
    """What an update's pairs must split into: every device of ``data_parallel`` and every
    micro-batch of ``grad_accum_steps`` gets the same number of whole pairs, so
    ``batch_size`` (pairs) must be a multiple of devices x grad_accum_steps (absent and 1
    are one spelling of no accumulation)."""
    pairs, devices = training["batch_size"], training["data_parallel"]["devices"]
    accum = training.get("grad_accum_steps", 1)
    if accum == 1:
        training.pop("grad_accum_steps", None)
    if pairs % devices:
        return [
            {
                "path": "/training/data_parallel/devices",
                "message": f"must divide training.batch_size={pairs} (every device gets the same "
                f"number of whole pairs; got {devices})",
            }
        ]
    if pairs % (devices * accum):
        return [
            {
                "path": "/training/grad_accum_steps",
                "message": f"must divide training.batch_size={pairs} into micro-batches whose "
                f"pairs split evenly over training.data_parallel.devices={devices}: batch_size "
                f"must be a multiple of devices x grad_accum_steps = {devices * accum} "
                f"(got {accum})",
            }
        ]
    return []
