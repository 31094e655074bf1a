"""Memory defaults on the TPU: a recipe that names it (``runtime.backend: tpu``) gets remat of
every block and the loss over token chunks where it leaves them out, written into the
validated recipe and so into its digest; a recipe that does not name it keeps its digest."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from conftest import run_worker, write_recipe

from minifield import cli
from minifield import recipe as recipes

REPO = Path(__file__).resolve().parents[1]
#: the shipped recipes with a transformer's execution options (the strategies that read them)
LM_RECIPES = ["sft-demo", "llama-sft-demo", "grpo-demo", "preference-demo"]


def shipped(name: str) -> dict:
    return recipes.read_document(REPO / "config" / "recipes" / f"{name}.yaml")


def with_runtime(document: dict, **runtime) -> dict:
    changed = copy.deepcopy(document)
    changed["runtime"] = {**changed.get("runtime", {}), **runtime}
    return changed


@pytest.mark.parametrize("name", LM_RECIPES)
def test_a_tpu_recipe_computes_as_if_it_spelled_the_memory_options_out(name):
    document = shipped(name)
    if name == "preference-demo":  # its reference input is a pipeline product: pin any file
        document["inputs"].append({"name": "reference", "path": "x", "sha256": "0" * 64})
    on_tpu = recipes.validate(with_runtime(document, backend="tpu"))
    assert on_tpu.data["training"]["remat"] == "full"
    assert on_tpu.data["training"]["loss_chunk_tokens"] == 1024
    spelled = copy.deepcopy(document)
    spelled["training"].update(remat="full", loss_chunk_tokens=1024)
    # runtime is not in the digest: the same computation as the CPU recipe that spells them
    assert on_tpu.computation_digest == recipes.validate(spelled).computation_digest
    assert on_tpu.computation_digest != recipes.validate(document).computation_digest


def test_options_a_tpu_recipe_spells_are_its_own():
    document = shipped("sft-demo")
    document["training"].update(remat="none", loss_chunk_tokens=4096)
    on_tpu = recipes.validate(with_runtime(document, backend="tpu"))
    assert "remat" not in on_tpu.data["training"]  # none: the default, removed as always
    assert on_tpu.data["training"]["loss_chunk_tokens"] == 4096
    document["training"]["remat"] = "none"
    assert on_tpu.computation_digest == recipes.validate(document).computation_digest


@pytest.mark.parametrize("backend", [None, "any", "cpu", "gpu"])
@pytest.mark.parametrize("name", LM_RECIPES[:3])
def test_other_backends_keep_the_recipe_as_written(name, backend):
    document = shipped(name)
    checked = recipes.validate(with_runtime(document, backend=backend) if backend else document)
    assert "remat" not in checked.data["training"]
    assert "loss_chunk_tokens" not in checked.data["training"]
    assert checked.computation_digest == recipes.validate(document).computation_digest


def test_a_tpu_recipe_with_the_fused_kernel_needs_rows_of_whole_lanes():
    """``model.attention: pallas`` on a TPU is splash attention (tests/test_tpu_attention.py):
    rows of a multiple of 128 tokens; another length is refused naming the field."""
    document = shipped("sft-demo")
    document["model"]["attention"] = "pallas"
    with pytest.raises(recipes.RecipeError) as caught:
        recipes.validate(with_runtime(document, backend="tpu"))  # seq_len 64
    assert [e["path"] for e in caught.value.errors] == ["/model/attention"]
    assert "multiple of 128 (got 64)" in caught.value.errors[0]["message"]
    document["training"]["seq_len"] = 256
    checked = recipes.validate(with_runtime(document, backend="tpu"))
    assert checked.data["model"]["attention"] == "pallas"


def fp32_splash() -> dict:
    """sft-demo on the TPU with the fused kernel (splash) and FP32 compute, rows of 256."""
    document = with_runtime(shipped("sft-demo"), backend="tpu")
    document["model"].update(attention="pallas", compute_dtype="float32")
    document["training"]["seq_len"] = 256
    return document


def test_a_tpu_recipe_with_the_fused_kernel_and_fp32_compute_is_refused(tmp_path, capsys):
    """Splash's products ask for no precision (one BF16 pass on a TPU), so FP32 compute with
    it is refused at check, in one line naming the field and the XLA path; ``minifield
    validate`` exits 2. BF16 with it, and FP32 with the XLA path, are accepted."""
    document = fp32_splash()
    with pytest.raises(recipes.RecipeError) as caught:
        recipes.validate(document)
    assert [e["path"] for e in caught.value.errors] == ["/model/attention"]
    message = caught.value.errors[0]["message"]
    assert "\n" not in message
    assert "compute_dtype float32" in message and "use model.attention xla" in message
    job = write_recipe(tmp_path / "fp32-splash.json", document)
    assert cli.main(["validate", str(job)]) == 2
    header, problem = capsys.readouterr().err.splitlines()
    assert header.endswith("invalid recipe (1 problem(s)):")
    assert problem.strip() == f"/model/attention: {message}"
    recipes.validate({**document, "model": {**document["model"], "compute_dtype": "bfloat16"}})
    recipes.validate({**document, "model": {**document["model"], "attention": "xla"}})


@pytest.mark.slow  # starts the worker
def test_the_worker_refuses_fp32_splash_with_exit_2(tmp_path):
    job = write_recipe(tmp_path / "fp32-splash.json", fp32_splash())
    verdict = json.loads(run_worker("--validate-only", job=job, check_codes=[2]).stdout)
    assert verdict["valid"] is False
    assert [e["path"] for e in verdict["errors"]] == ["/model/attention"]
    assert "use model.attention xla" in verdict["errors"][0]["message"]


def splash_recipe() -> dict:
    """sft-demo on the TPU with splash attention, rows of 256."""
    document = with_runtime(shipped("sft-demo"), backend="tpu")
    document["model"]["attention"] = "pallas"
    document["training"]["seq_len"] = 256
    return document


def test_a_splash_recipe_records_the_block_table_so_its_digest_follows_the_table(monkeypatch):
    """Splash's block sizes come from ``execution.SPLASH_BLOCKS`` and change what the recipe
    computes: the table's digest is filled into the validated recipe (as the memory defaults
    are), so another table is another computation; a recipe that does not run splash (the
    XLA path, another backend) gets none and keeps its digest."""
    from minifield.models import execution

    checked = recipes.validate(splash_recipe())
    assert checked.data["model"]["splash_table"] == execution.splash_table_digest()
    spelled = splash_recipe()
    spelled["model"]["splash_table"] = execution.splash_table_digest()
    assert recipes.validate(spelled).computation_digest == checked.computation_digest
    for other in ({"attention": "xla"}, {}):
        document = splash_recipe()
        document["model"].update(other)
        if not other:
            document["runtime"]["backend"] = "gpu"
        assert "splash_table" not in recipes.validate(document).data["model"]
    table = {
        **execution.SPLASH_BLOCKS,
        256: {64: dict.fromkeys(execution.SPLASH_DEFAULT_BLOCKS, 256)},
    }
    monkeypatch.setattr(execution, "SPLASH_BLOCKS", table)
    assert recipes.validate(splash_recipe()).computation_digest != checked.computation_digest


def test_a_splash_table_the_code_does_not_have_or_without_splash_is_refused():
    document = splash_recipe()
    document["model"]["splash_table"] = "0" * 16
    with pytest.raises(recipes.RecipeError) as caught:
        recipes.validate(document)
    assert [e["path"] for e in caught.value.errors] == ["/model/splash_table"]
    assert "not this code's table" in caught.value.errors[0]["message"]
    document["model"]["attention"] = "xla"
    with pytest.raises(recipes.RecipeError) as caught:
        recipes.validate(document)
    assert "pallas and runtime.backend tpu" in caught.value.errors[0]["message"]


def attention_on_tpu(seq_len: int, **model) -> dict:
    """sft-demo on the TPU with rows of ``seq_len`` tokens, ``model.attention`` left out."""
    document = with_runtime(shipped("sft-demo"), backend="tpu")
    document["training"]["seq_len"] = seq_len
    document["model"].update(model)
    return recipes.validate(document).data["model"]


def test_the_tpu_default_attention_is_the_faster_one_measured_at_the_row_length():
    """On the chip (docs/splash-blocks.json, the sweep the table is made from) splash beat the
    XLA path at every recorded row length from ``SPLASH_FASTER_FROM`` up and lost below it;
    a TPU recipe that leaves ``model.attention`` out gets splash exactly there, written into
    the validated recipe (with its table digest) like the memory options."""
    from minifield.models import execution

    recorded = json.loads((REPO / "docs" / "splash-blocks.json").read_text())
    timed = [s for s in recorded["shapes"] if "ms" in s["xla"] and "ms" in s["best"]]
    assert {s["seq_len"] for s in timed} >= {128, 256, 512, 1024, 2048, 4096}
    for shape in timed:
        splash_faster = shape["best"]["ms"] < shape["xla"]["ms"]
        assert splash_faster == (shape["seq_len"] >= execution.SPLASH_FASTER_FROM), shape
        model = attention_on_tpu(shape["seq_len"])
        assert model.get("attention", "xla") == ("pallas" if splash_faster else "xla")
    assert attention_on_tpu(2048)["splash_table"] == execution.splash_table_digest()
    assert "splash_table" not in attention_on_tpu(256)


def test_the_tpu_default_attention_is_the_xla_path_where_splash_cannot_run():
    """Splash needs whole lanes and BF16 compute: a 640-token row gets it, 576 (not a multiple
    of 128) and FP32 compute keep the XLA path; a spelled kernel is the recipe's own."""
    assert attention_on_tpu(640)["attention"] == "pallas"
    assert "attention" not in attention_on_tpu(576)
    assert "attention" not in attention_on_tpu(2048, compute_dtype="float32")
    assert "attention" not in attention_on_tpu(2048, attention="xla")


def test_the_tpu_default_attention_is_in_the_digest():
    """Absent on a TPU at 2048 tokens is the computation that spells splash out; the XLA path
    spelled is another computation."""
    document = with_runtime(shipped("sft-demo"), backend="tpu")
    document["training"]["seq_len"] = 2048
    absent = recipes.validate(document).computation_digest
    spelled = copy.deepcopy(document)
    spelled["model"]["attention"] = "pallas"
    assert recipes.validate(spelled).computation_digest == absent
    spelled["model"]["attention"] = "xla"
    assert recipes.validate(spelled).computation_digest != absent
