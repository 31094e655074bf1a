"""two-stage bad inputs through the real worker: exit 2, an error naming the file, nothing
trained (no checkpoint, no export)."""

import json

import pytest
from conftest import run_worker, write_recipe
from test_two_stage import (
    _pin,
    corpus_pins,
    export_stage1,
    linked,
    pair_pins,
    pretrain_recipe,
    sft_recipe,
)

from minifield import recipe as recipes

pytestmark = pytest.mark.slow  # starts the worker


def _refused(recipe: dict, root, tmp_path) -> tuple[dict, str]:
    job = write_recipe(tmp_path / f"{recipe['job_id']}.json", recipe)
    out = tmp_path / "out"
    proc = run_worker(job=job, input_root=root, output_root=out, check_codes=[2])
    (attempt,) = (out / recipe["job_id"]).iterdir()
    result = json.loads((attempt / "result.json").read_text())
    assert result["status"] == "failed" and result["steps_completed"] == 0  # exit 2 above
    assert result["checkpoint"] is None and not (attempt / "export").exists()
    assert not list(attempt.rglob("step-*"))
    assert "Traceback" not in proc.stderr
    return result, proc.stderr


def test_worker_refuses_a_non_utf8_corpus_and_a_stage1_result_of_another_digest(tmp_path):
    root = tmp_path / "data"
    pins = corpus_pins(root)
    pins["train"] = _pin(root, "corpus/latin1.txt", b"na\xefve text\n")
    result, stderr = _refused(pretrain_recipe(pins), root, tmp_path / "a")
    assert result["error"]["phase"] == "examples"
    assert f"{root / 'corpus' / 'latin1.txt'}: not valid UTF-8" in result["error"]["message"]
    assert "latin1.txt: not valid UTF-8" in stderr

    recipe = pretrain_recipe(corpus_pins(root))
    export = export_stage1(root, recipe, tmp_path / "export")
    concrete = linked(
        root, export, recipes.validate(recipe).computation_digest, sft_recipe(pair_pins(root))
    )
    concrete["model"]["init"]["stage1"]["computation_digest"] = "f" * 64
    result, _ = _refused(concrete, root / "linked", tmp_path / "b")
    assert (
        "stage1/model.json: the export is the result of stage-1 computation"
        in result["error"]["message"]
    )
