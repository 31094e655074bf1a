"""Memory defaults on the TPU: a recipe that names it (``runtime.backend: tpu``) gets remat of
every block and the loss over token chunks where it leaves them out, written into the
validated recipe and so into its digest; a recipe that does not name it keeps its digest."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from conftest import run_worker, small_sft_inputs, small_sft_recipe, write_recipe

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


#: the remat a TPU recipe gets: packed-sft's step of a Llama model is estimated, so it gets
#: ``auto`` (the policy and micro-batches chosen from the model's shape); the others (the GPT
#: demo, preference, grpo) ``full``
TPU_REMAT = {"llama-sft-demo": "auto"}


def with_reference(name: str) -> dict:
    document = shipped(name)
    if name == "preference-demo":  # its reference input is a pipeline product: pin any file
        document["inputs"].append({"name": "reference", "path": "x", "sha256": "0" * 64})
    return document


@pytest.mark.parametrize("name", LM_RECIPES)
def test_a_tpu_recipe_computes_as_if_it_spelled_the_memory_options_out(name):
    from minifield.models import device_memory

    document = with_reference(name)
    on_tpu = recipes.validate(with_runtime(document, backend="tpu"))
    remat = TPU_REMAT.get(name, "full")
    assert on_tpu.data["training"]["remat"] == remat
    assert on_tpu.data["training"]["loss_chunk_tokens"] == 1024
    rule = {"remat_rule": device_memory.auto_rule_digest()} if remat == "auto" else {}
    assert {k: v for k, v in on_tpu.data["training"].items() if k == "remat_rule"} == rule
    spelled = copy.deepcopy(document)
    spelled["training"].update(remat=remat, loss_chunk_tokens=1024)
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
    """Splash's block sizes come from ``splash_table.SPLASH_BLOCKS`` and change what the recipe
    computes: the table's digest is filled into the validated recipe (as the memory defaults
    are), so another table is another computation; a recipe that does not run splash (the
    XLA path, another backend) gets none and keeps its digest."""
    from minifield.models import splash_table

    checked = recipes.validate(splash_recipe())
    assert checked.data["model"]["splash_table"] == splash_table.splash_table_digest()
    spelled = splash_recipe()
    spelled["model"]["splash_table"] = splash_table.splash_table_digest()
    assert recipes.validate(spelled).computation_digest == checked.computation_digest
    for other in ({"attention": "xla"}, {}):
        document = splash_recipe()
        document["model"].update(other)
        if not other:
            document["runtime"]["backend"] = "gpu"
        assert "splash_table" not in recipes.validate(document).data["model"]
    table = {
        **splash_table.SPLASH_BLOCKS,
        256: {64: dict.fromkeys(splash_table.SPLASH_DEFAULT_BLOCKS, 256)},
    }
    monkeypatch.setattr(splash_table, "SPLASH_BLOCKS", table)
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
    from minifield.models import execution, splash_table

    recorded = json.loads((REPO / "docs" / "splash-blocks.json").read_text())
    timed = [s for s in recorded["shapes"] if "ms" in s["xla"] and "ms" in s["best"]]
    assert {s["seq_len"] for s in timed} >= {128, 256, 512, 1024, 2048, 4096}
    for shape in timed:
        splash_faster = shape["best"]["ms"] < shape["xla"]["ms"]
        assert splash_faster == (shape["seq_len"] >= execution.SPLASH_FASTER_FROM), shape
        model = attention_on_tpu(shape["seq_len"])
        assert model.get("attention", "xla") == ("pallas" if splash_faster else "xla")
    assert attention_on_tpu(2048)["splash_table"] == splash_table.splash_table_digest()
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


def auto_sft(**training) -> dict:
    document = with_runtime(shipped("llama-sft-demo"), backend="tpu")
    document["training"].update(training)
    return document


def test_the_remat_rule_follows_the_rule_so_the_digest_does(monkeypatch):
    """``auto``'s choice changes what the recipe computes (policy, micro-batches), so the
    rule's digest is written into the validated recipe: another rule (a floor of 4096 tokens
    a micro-batch) is another computation; spelling the rule is the same one."""
    from minifield.models import device_memory

    checked = recipes.validate(auto_sft())
    spelled = recipes.validate(auto_sft(remat_rule=device_memory.auto_rule_digest()))
    assert spelled.computation_digest == checked.computation_digest
    monkeypatch.setattr(device_memory, "AUTO_MIN_MICRO_TOKENS", 4096)
    again = recipes.validate(auto_sft())
    assert again.data["training"]["remat_rule"] != checked.data["training"]["remat_rule"]
    assert again.computation_digest != checked.computation_digest


@pytest.mark.parametrize(
    ("training", "path", "words"),
    [
        ({"remat_rule": "0" * 16}, "/training/remat_rule", "not this code's rule"),
        ({"remat": "full", "remat_rule": "0" * 16}, "/training/remat_rule", "remat auto only"),
    ],
)
def test_a_remat_rule_the_code_does_not_have_or_without_auto_is_refused(training, path, words):
    with pytest.raises(recipes.RecipeError) as caught:
        recipes.validate(auto_sft(**training))
    assert [e["path"] for e in caught.value.errors] == [path]
    assert words in caught.value.errors[0]["message"]


@pytest.mark.parametrize("name", ["grpo-demo", "preference-demo", "sft-demo"])
def test_auto_is_refused_where_the_step_is_not_estimated(name):
    """Only packed-sft's step memory of a Llama model is estimated: a preference, grpo or GPT
    recipe naming ``auto`` (on any backend) is refused, naming the field and the policies."""
    document = with_reference(name)
    document["training"]["remat"] = "auto"
    with pytest.raises(recipes.RecipeError) as caught:
        recipes.validate(document)
    assert [e["path"] for e in caught.value.errors] == ["/training/remat"]
    assert "name a policy (full," in caught.value.errors[0]["message"]


def test_the_program_computes_what_auto_chose_as_the_recipe_spelling_it(tmp_path, monkeypatch):
    """The program built from a ``remat: auto`` recipe runs the plan it chose for the model's
    shape, the same update as the recipe spelling that policy and split: the tiny model fits
    in one micro-batch; sized for a device just large enough for two micro-batches (and no
    floor) it splits its 8 rows in two."""
    from minifield.inputs import pinned
    from minifield.models import device_memory
    from minifield.strategies.lm import model_section

    inputs = small_sft_inputs(tmp_path)

    def program(**training):
        document = small_sft_recipe(inputs["pins"], "auto", 1, training=training)
        document["model"]["architecture"] = "llama"
        recipe = recipes.validate(document)
        files = pinned.files_by_name(recipe.data, inputs["input_root"])
        arrays, _ = recipe.strategy.prepare(recipe.data, files)
        return recipe.strategy.build(recipe.data, arrays), recipe, arrays

    auto, recipe, arrays = program(remat="auto")
    assert auto.cfg.execution.remat == "dots_saveable" and auto.accum_steps == 1
    spelled, _, _ = program(remat="dots_saveable")
    assert auto.cfg.execution == spelled.cfg.execution
    assert auto.memory_plan["estimated_bytes"] <= device_memory.AUTO_DEVICE_BYTES
    tokenizer, _ = model_section.tokenizer_of(recipe.data, arrays)
    cfg = model_section.config_of(recipe.data, arrays, tokenizer)
    estimate = device_memory.estimate(
        cfg, device_memory.with_plan(recipe.data, device_memory.Plan("dots_saveable", 2))
    )["total"]
    monkeypatch.setattr(device_memory, "AUTO_DEVICE_BYTES", estimate)
    monkeypatch.setattr(device_memory, "AUTO_MIN_MICRO_TOKENS", 1)
    split, _, _ = program(remat="auto")
    assert split.cfg.execution.remat == "dots_saveable" and split.accum_steps == 2
    assert split.memory_plan == {
        "remat": "dots_saveable", "grad_accum_steps": 2, "estimated_bytes": estimate,
    }  # fmt: skip
    spelled, _, _ = program(remat="dots_saveable", grad_accum_steps=2)
    assert (split.cfg.execution, split.accum_steps) == (spelled.cfg.execution, 2)
