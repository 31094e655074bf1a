"""The stages before training: validate the recipe, fetch remote inputs into the
computation's own input root, hash the inputs, prepare the examples, quantize the base.

None imports JAX, so these jobs start quickly.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from .. import atomic
from .. import recipe as recipes
from ..digest import sha256_file, short
from ..harness import tasks as harness_tasks
from ..hf import quantized_base
from ..inputs import examples, fetch, pinned
from .errors import StageError


def validate(recipe_path: Path, out_recipe: Path, out_validation: Path) -> None:
    """Validated recipe (defaults filled) plus a validation record with both digests."""
    recipe = recipes.load(recipe_path)
    atomic.write_json(out_recipe, recipe.data)
    atomic.write_json(
        out_validation,
        {
            "valid": True,
            "source": str(recipe_path),
            "source_sha256": sha256_file(recipe_path),
            "computation_digest": recipe.computation_digest,
            "examples_digest": recipe.examples_digest,
            "strategy": {"name": recipe.strategy.name, "version": recipe.strategy.version},
        },
    )


def hash_inputs(recipe_json: Path, input_root: Path, out_inputs: Path) -> None:
    """Verify every pinned input (and read the harness task files, refused before any
    training when one could not run offline); record them."""
    recipe = recipes.load(recipe_json)
    verified = pinned.verify(recipe.data, input_root)
    try:
        harness_tasks.resolve_pinned(recipe.data, input_root)
    except harness_tasks.HarnessTaskError as exc:
        raise StageError(str(exc)) from None
    atomic.write_json(
        out_inputs,
        {
            "computation_digest": recipe.computation_digest,
            "input_root": str(input_root),
            "inputs": verified,
        },
    )


def prepare(
    recipe_json: Path, input_root: Path, out_dir: Path, sources_root: Path | None = None
) -> dict:
    """Prepare a recipe's examples into ``out_dir``. With ``sources_root``, the training
    sources the strategy prepares on their own are read from ``sources_root/{sdigest}``
    (:func:`prepare_source` wrote them; their digests checked), not prepared again."""
    recipe = recipes.load(recipe_json)
    pinned.verify(recipe.data, input_root)
    files = pinned.files_by_name(recipe.data, input_root)
    if sources_root is None or not recipe.source_digests:
        arrays, meta = recipe.strategy.prepare(recipe.data, files)
    else:
        loaded = {
            name: examples.load(Path(sources_root) / short(digest), digest)
            for name, digest in recipe.source_digests.items()
        }
        sources = {name: (rows, manifest["meta"]) for name, (rows, manifest) in loaded.items()}
        arrays, meta = recipe.strategy.prepare(recipe.data, files, sources=sources)
    return examples.write(out_dir, arrays, meta, recipe.examples_digest)


def quantize_base(recipe_json: Path, examples_dir: Path, out_dir: Path) -> dict:
    """Write the recipe's quantized base into ``out_dir`` (addressed by its quantized-base
    digest, shared by every recipe that quantizes the same base the same way), from the
    base its prepared examples hold (verified), one matrix at a time."""
    recipe = recipes.load(recipe_json)
    if recipe.quantized_base_digest is None:
        raise StageError(f"{recipe_json}: model.lora.base_quantization is not set")
    arrays, _ = examples.load(examples_dir, recipe.examples_digest)
    return quantized_base.make(recipe.data, arrays, out_dir)


def prepare_source(recipe_json: Path, input_root: Path, name: str, out_dir: Path) -> dict:
    """Prepare the recipe's training source ``name`` on its own into ``out_dir`` (addressed by
    its source digest, shared by every recipe with the same source)."""
    recipe = recipes.load(recipe_json)
    pinned.verify(recipe.data, input_root)
    files = pinned.files_by_name(recipe.data, input_root)
    arrays, meta = recipe.strategy.prepare_source(recipe.data, name, files)
    return examples.write(out_dir, arrays, meta, recipe.source_digests[name])


def fetch_inputs(
    recipe_json: Path,
    remote_config: dict,
    work_dir: Path,
    local_input_root: Path,
    out_root: Path,
    out_record: Path,
) -> dict:
    """Pipeline stage: build a computation's own input root (remote inputs by name, local
    inputs linked at their paths), then move it into place in one rename.

    The worker resolves every input under a single input root, so a recipe with remote
    inputs gets this per-computation root instead of the configured one.
    """
    loaded = recipes.load(recipe_json)
    recipe = loaded.data
    settings = fetch.Settings.from_config(remote_config, work_dir)
    remote_names = {item["name"] for item in fetch.remote_items(recipe)}
    out_root = Path(out_root)
    out_root.parent.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=f".{out_root.name}.", dir=out_root.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(building, 0o777 & ~umask)  # mkdtemp's 0700 is for the temporary name only
    try:
        local = []
        for item in recipe.get("inputs", []):
            if "path" not in item:
                continue
            if item["path"] in remote_names:
                raise fetch.FetchError(
                    f"input {item['name']!r}: path {item['path']!r} collides with the name of a "
                    "remote input (remote inputs are placed at the input root under their name)"
                )
            source = pinned.resolve(local_input_root, item["path"])
            if not source.is_file():
                raise fetch.FetchError(f"input {item['name']!r}: {source} does not exist")
            fetch.place(source, building / item["path"])
            local.append({"name": item["name"], "path": item["path"]})
        remote = fetch.fetch_inputs(recipe, building, settings)
        if out_root.exists():
            shutil.rmtree(out_root)
        os.replace(building, out_root)
    finally:
        if building.exists():
            shutil.rmtree(building)
    record = {
        "computation_digest": loaded.computation_digest,
        "input_root": str(out_root),
        "cache_dir": str(settings.cache_dir),
        "remote": remote,
        "local": local,
    }
    atomic.write_json(out_record, record)
    return record
