"""The reference model's per-answer log-probabilities: a product computed once per pair set.

DPO and IPO compare the policy with a reference model on every pair. The reference never
changes during training, so its log-probabilities are computed once, before training, by
:func:`compute` (the command ``minifield reference-logprobs``) into a directory addressed by
:func:`reference_digest`: the digest of the reference model's pins (the base model's files
and compute dtype), the prepared pairs (each split's sha256, ``seq_len``, ``overlong``, the
prepare version) and the chat template. The loss, β and everything else a sweep varies are
not in it, so recipes differing only in those share one product. With LoRA the reference is
the frozen base (adapters off), which is what the recipe's base is.

A recipe with ``training.data_parallel.devices`` N > 1 computes its reference on the same
mesh as its update (:func:`compute`: each batch's rows split over the N devices, the base's
parameters replicated or, with ``shard_params``, sharded as the training state is), so a base
that needs the mesh to fit has its reference too. The values are one device's within FP32
rounding, not its bits (other partial sums), so the spec, and the address, holds the recipe's
``data_parallel`` section when N > 1: one address, one set of bits. On one device the key is
absent, so every product computed before keeps its address.

The directory holds:

- ``reference.safetensors``: per split ``{split}.chosen`` and ``{split}.rejected``, the summed
  log-probabilities of each pair of the file in file order (float32; NaN for a pair the
  packing dropped), and the digest in the file's metadata (:data:`DIGEST_KEY`);
- ``reference.json``: what it is (the digest and the spec it hashes, pair counts, the
  data file's sha256).

A preference recipe pins ``reference.safetensors`` as an input (its sha256, as every input:
a tampered file is refused before anything reads it), names it in ``preference.reference``,
and :func:`load` refuses a file whose recorded digest is not the recipe's.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np

from ...digest import sha256_bytes, sha256_json
from ...inputs.pinned import InputError, location, resolve
from ..lm import model_section as sft_settings
from .prepared import PREPARE_VERSION
from .section import SPLITS

DATA_FILE, RECORD_FILE = "reference.safetensors", "reference.json"
#: the safetensors metadata key holding the digest the file was computed for
DIGEST_KEY = "minifield.reference_digest"
#: bumped when the same spec computes other numbers
REFERENCE_VERSION = 1
#: the pin of a reference input a recipe does not pin yet (never read)
PLACEHOLDER_SHA256 = "0" * 64
#: the evaluation batch (packed rows) the reference pass runs at
BATCH_ROWS = 64


class ReferenceError(InputError):
    """A reference file that is not the one for this recipe (an invalid input: exit 2)."""


def pending(document: dict) -> dict:
    """A copy of a recipe document whose reference input is not pinned yet (the file about
    to be computed), with a placeholder pin (:data:`PLACEHOLDER_SHA256`, never read) so that
    the rest of it validates; :func:`pairs_data` drops it again."""
    out = copy.deepcopy(document)
    section = out.get("preference")
    named = section.get("reference") if isinstance(section, dict) else None
    inputs = out.get("inputs")
    if isinstance(named, str) and isinstance(inputs, list):
        if named not in [i.get("name") for i in inputs if isinstance(i, dict)]:
            inputs.append({"name": named, "path": named, "sha256": PLACEHOLDER_SHA256})
    return out


def pairs_data(recipe) -> dict:
    """A validated recipe's data (``recipe``: a :class:`minifield.recipe.Recipe` or its
    ``data``) without its reference input: the pairs and base the reference is computed
    from."""
    data = copy.deepcopy(recipe.data if hasattr(recipe, "data") else recipe)
    named = data["preference"].get("reference")
    data["inputs"] = [i for i in data["inputs"] if i["name"] != named]
    return data


def spec(data: dict) -> dict:
    """What the reference depends on, from a validated recipe's data."""
    model, training = data["model"], data["training"]
    pinned = {i["name"]: i["sha256"] for i in data["inputs"]}
    names = sft_settings.base_model_inputs(model)
    data_parallel = {"devices": 1, "shard_params": False, **training.get("data_parallel", {})}
    return {
        "what": "preference reference log-probabilities",
        "version": REFERENCE_VERSION,
        "prepare_version": PREPARE_VERSION,
        "base": model["base"],
        "base_inputs": {name: pinned[name] for name in sorted(names)},
        "compute_dtype": model["compute_dtype"],
        "chat_template": model.get("chat_template"),
        "pairs": {split: pinned[split] for split in SPLITS},
        "seq_len": training["seq_len"],
        "overlong": training["overlong"],
        # on one device absent (the addresses of products computed before it existed)
        **({"data_parallel": data_parallel} if data_parallel["devices"] > 1 else {}),
    }


def reference_digest(recipe, input_root) -> str:
    """The digest addressing a validated recipe's reference directory (see the module
    docstring; ``recipe``: a :class:`minifield.recipe.Recipe` or its ``data``).

    Reads no file: the pins say what the files hold, and :func:`compute`
    verifies them. A pair or base input missing under ``input_root`` is refused
    (:class:`~minifield.inputs.pinned.InputError`, naming it), so no address is given out
    for files that are not there."""
    data = pairs_data(recipe)
    described = spec(data)
    wanted = {*described["base_inputs"], *SPLITS}
    for item in data["inputs"]:
        if item["name"] in wanted and "path" in item:
            path = resolve(Path(input_root), location(item))
            if not path.is_file():
                raise InputError(f"input {item['name']!r}: {path} does not exist")
    return sha256_json(described)


def compute(recipe, input_root, out_dir) -> dict:
    """Compute the reference log-probabilities of a validated recipe (a
    :class:`minifield.recipe.Recipe` or its ``data``) into ``out_dir`` (see the module
    docstring); returns the record written as ``reference.json``. Every pinned input is verified first;
    nothing is written unless all of it is computed."""
    from ... import atomic
    from ...inputs import pinned
    from . import logprobs, pairs, prepared

    data = pairs_data(recipe)
    pinned.verify(data, Path(input_root))
    files = pinned.files_by_name(data, Path(input_root))
    arrays, meta = prepared.prepare_pairs(data, files)
    # the plain forward (no fused kernel, no loss chunks): one product for every execution
    data = {**data, "model": {**data["model"]}, "training": {**data["training"]}}
    for section, key in (
        ("model", "attention"),
        ("model", "splash_table"),
        ("training", "loss_chunk_tokens"),
    ):
        data[section].pop(key, None)
    cfg, params, _ = prepared.model_of(data, arrays)
    forward, rows = _forward(cfg, params, data["training"])
    tensors, counts = {}, {}
    for split in SPLITS:
        n_pairs = int(arrays[f"{split}_pairs"])
        values = logprobs.by_pair(forward, pairs.PairRows.of(arrays, split), rows, n_pairs)
        tensors[f"{split}.chosen"] = values["chosen"]
        tensors[f"{split}.rejected"] = values["rejected"]
        counts[split] = {"pairs": n_pairs, "packed": meta["splits"][split]["packed"]}
    described = spec(data)
    digest = sha256_json(described)
    from safetensors.numpy import save

    payload = save(tensors, metadata={DIGEST_KEY: digest})
    record = {
        "digest": digest,
        "spec": described,
        "splits": counts,
        "files": {DATA_FILE: sha256_bytes(payload)},
    }
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic.write_bytes(out_dir / DATA_FILE, payload)
    atomic.write_bytes(out_dir / RECORD_FILE, (json.dumps(record, indent=2) + "\n").encode())
    return record


def _forward(cfg, params, training: dict):
    """``(forward(batch) -> answer_logps, rows per batch)``: on one device, or on the mesh of
    ``training.data_parallel`` (the batch's rows split over ``data``, the parameters placed as
    the training state's, :mod:`minifield.training.data_parallel`)."""
    import jax

    from ...training import data_parallel
    from . import logprobs

    dp = data_parallel.DataParallel.from_training(training)
    logps = jax.jit(lambda p, batch: logprobs.answer_logps(p, cfg, batch))
    if dp.devices == 1:
        return (lambda batch: logps(params, batch)), BATCH_ROWS
    mesh = dp.mesh()
    abstract = jax.eval_shape(lambda: {"params": params})
    placed = data_parallel.place_tree(params, dp.state_shardings(mesh, abstract)["params"])
    rows = dp.batch_sharding(mesh)
    return (
        lambda batch: logps(placed, jax.device_put(batch, rows)),
        -(-BATCH_ROWS // dp.devices) * dp.devices,
    )


def load(path: Path, data: dict, pair_counts: dict[str, int]) -> dict[str, np.ndarray]:
    """The reference arrays of the pinned file ``path`` for the validated recipe ``data``:
    refused (naming the file) unless its recorded digest is the recipe's and every split has
    one value per pair."""
    from safetensors import SafetensorError, safe_open

    want = sha256_json(spec(data))
    try:
        with safe_open(str(path), framework="numpy") as handle:
            recorded = (handle.metadata() or {}).get(DIGEST_KEY)
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
    except (SafetensorError, OSError) as exc:
        raise ReferenceError(f"{path}: not a readable reference file ({exc})") from None
    if recorded != want:
        raise ReferenceError(
            f"{path}: computed for reference digest {recorded}, but this recipe's pairs, base "
            f"model and chat template give {want} (recompute it: minifield reference-logprobs)"
        )
    for split, n in pair_counts.items():
        for side in ("chosen", "rejected"):
            key = f"{split}.{side}"
            if key not in tensors or tensors[key].shape != (n,):
                raise ReferenceError(f"{path}: {key} must hold {n} values (one per pair)")
    return tensors
