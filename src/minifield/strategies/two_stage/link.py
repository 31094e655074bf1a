"""The edge between the stages: a stage-2 recipe made concrete from a stage-1 export.

A stage-2 recipe as written (``config/recipes/two-stage-sft.yaml``) starts from a random
initialisation. :func:`stage2_recipe` turns it into the recipe that starts from a finished
stage 1: the export's files become pinned inputs (their sha256 read from the files, which
must match what the export's ``model.json`` lists) and ``model.init.stage1`` names them
together with the stage-1 computation digest. The stage-2 computation digest therefore
covers the stage-1 export's content, and through its ``model.json`` everything upstream.

Stage 2's own input root (the recipe's local inputs at their paths, the export's files under
``stage1/``) is made by the chains' one link mechanism (``pipeline/chains.py`` with
``inputs/linked_root.make``), in the pipeline's ``two_stage_link`` rule after stage 1 trained.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

from ...digest import sha256_file
from ...inputs.linked_root import LinkError
from ...state import export
from .stage1_export import FILES

#: stage-2 input name of each export file
INPUT_NAMES = {key: f"stage1-{key}" for key in FILES}
#: where the export's files go under the stage-2 input root
STAGE1_DIR = "stage1"


def check_export(export_dir: Path, stage1_digest: str) -> dict:
    """The export's ``model.json``; refuses a missing export or another computation's."""
    record_path = Path(export_dir) / export.MODEL_FILE
    if not record_path.is_file():
        raise LinkError(f"{record_path}: missing: no stage-1 result to start stage 2 from")
    try:
        record = json.loads(record_path.read_text(encoding="utf-8"))
        config = record["config"]
        recorded = config.get("computation_digest")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise LinkError(f"{record_path}: not an export record ({exc})") from None
    if config.get("stage") != "pretrain":
        raise LinkError(f"{record_path}: not a stage-1 (pretrain) export")
    if recorded != stage1_digest:
        raise LinkError(
            f"{record_path}: the export of stage-1 computation {recorded}, but stage 1 here "
            f"is computation {stage1_digest} (another digest)"
        )
    return record


def stage2_recipe(template: dict, export_dir: Path, stage1_digest: str) -> dict:
    """The stage-2 recipe ``template`` starting from the stage-1 export in ``export_dir``."""
    record = check_export(export_dir, stage1_digest)
    listed = {entry["file"]: entry["sha256"] for entry in record["files"]}
    recipe = copy.deepcopy(template)
    if (recipe.get("model") or {}).get("init"):
        raise LinkError("the stage-2 recipe already has model.init (the link writes it)")
    taken = {item["name"] for item in recipe.get("inputs", [])} & set(INPUT_NAMES.values())
    if taken:
        raise LinkError(f"the stage-2 recipe already has inputs named {sorted(taken)}")
    for key, file_name in FILES.items():
        path = Path(export_dir) / file_name
        actual = sha256_file(path) if path.is_file() else None
        if file_name != export.MODEL_FILE and actual != listed.get(file_name):
            raise LinkError(
                f"{path}: sha256 {actual} is not the {listed.get(file_name)} model.json lists"
            )
        recipe.setdefault("inputs", []).append(
            {"name": INPUT_NAMES[key], "path": f"{STAGE1_DIR}/{file_name}", "sha256": actual}
        )
    recipe.setdefault("model", {})["init"] = {
        "stage1": {"computation_digest": stage1_digest, **INPUT_NAMES}
    }
    return recipe
