"""A preference recipe made concrete from its reference product (the pipeline's reference
link, docs/preference.md "The pipeline").

DPO and IPO read the reference model's log-probabilities from a pinned input
(``preference.reference``). In the pipeline that file is a product, computed once per
reference digest into ``results/reference/{r}/`` (:func:`.reference.compute`), and the
recipe as written pins it with any sha256 (:data:`.reference.PLACEHOLDER_SHA256` says "not
yet"): :func:`reference_recipe` replaces that input by the product's file, pinned by the
sha256 its ``reference.json`` lists (the file is checked to have it), so the computation
digest covers the reference. The same kind of link as a chain's export → ``model.base``.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

from ...digest import sha256_file
from ...inputs.linked_root import LinkError
from .reference import DATA_FILE, RECORD_FILE
from .section import NAME, WITH_REFERENCE

#: where the product's file goes under the linked input root
PRODUCT_DIR = "reference"


def needs_reference(data: dict) -> bool:
    """Whether a validated recipe reads reference log-probabilities (preference DPO/IPO)."""
    return data["strategy"]["name"] == NAME and data["preference"]["loss"] in WITH_REFERENCE


def reference_recipe(template: dict, product_dir: Path) -> dict:
    """``template`` with its reference input pinned to the product in ``product_dir``."""
    record_path = Path(product_dir) / RECORD_FILE
    try:
        listed = json.loads(record_path.read_text(encoding="utf-8"))["files"][DATA_FILE]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise LinkError(f"{record_path}: not a reference record ({exc})") from None
    path = Path(product_dir) / DATA_FILE
    actual = sha256_file(path) if path.is_file() else None
    if actual != listed:
        raise LinkError(f"{path}: sha256 {actual} is not the {listed} {RECORD_FILE} lists")
    recipe = copy.deepcopy(template)
    named = recipe["preference"]["reference"]
    recipe["inputs"] = [item for item in recipe["inputs"] if item["name"] != named]
    recipe["inputs"].append({"name": named, "path": f"{PRODUCT_DIR}/{DATA_FILE}", "sha256": actual})
    return recipe
