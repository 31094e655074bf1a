"""The preference demo's before/after check (docs/preference.md "The demo"), on the demo's
data through real workers: the Llama SFT demo as shipped, trained by the README's run
(``readme_pipeline_run``: the pipeline's export of it, copied), then DPO chained on its
export (the reference computed from it), once with the demo recipe as shipped, which keeps
DEV exact-match within its tolerance (the check passes), and once with a destructive
learning rate, which the check refuses naming both numbers. The exact-match the check reads is
compared, pair by pair of a DEV slice, with greedy decoding by the float64 NumPy forward of
tests/family_reference.py on the exported weights (prompt tokenized here from the template's
layout, `<bos>prompt<sep>`; stop on the export's `eos_token_id`)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import yaml
from conftest import REPO, run_worker, write_recipe
from family_reference import reference_logits
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from minifield.pipeline import before_after, reference_logprobs
from minifield.strategies.lm import chain_base
from minifield.strategies.preference import reference_link

pytestmark = pytest.mark.slow  # real worker processes

RECIPES = REPO / "config" / "recipes"
#: the destructive run: ten updates of plain DPO at 3e-3 (300 times the demo's peak learning
#: rate; DEV exact-match 0.00 after it over 5 SFT seeds x Python 3.11 and 3.12,
#: docs/preference.md "Over seeds and machines")
DESTRUCTIVE = {"learning_rate": 3e-3, "warmup_steps": 1}


def _trained(recipe_path, input_root, output_root):
    run_worker(
        job=recipe_path, input_root=input_root, output_root=output_root, attempt_id="a",
        check_codes=(0,), timeout=1800,
    )  # fmt: skip
    (export,) = output_root.glob("*/a/export")
    return export


@pytest.fixture(scope="module")
def chained(readme_pipeline_run, tmp_path_factory):
    """The SFT demo's export and the DPO demo recipe chained on it (reference pinned)."""
    root = tmp_path_factory.mktemp("before-after")
    inputs = root / "inputs"
    shutil.copytree(REPO / "data" / "preference-demo", inputs / "preference-demo")
    sft = reference_logprobs.validated(RECIPES / "llama-sft-demo.yaml").computation_digest[:16]
    trained = readme_pipeline_run / "results" / "computations" / sft / "train" / "export"
    # copied where the chained recipe pins it; the README run's files stay as they are
    sft_export = shutil.copytree(trained, inputs / chain_base.PRODUCT_DIR)
    written = yaml.safe_load((RECIPES / "preference-demo.yaml").read_text())
    linked = write_recipe(root / "chained.json", chain_base.base_recipe(written, sft_export))
    reference_dir = inputs / reference_link.PRODUCT_DIR
    reference_logprobs.compute(linked, inputs, reference_dir)
    recipe = reference_link.reference_recipe(json.loads(linked.read_text()), reference_dir)
    return root, sft_export, recipe


def _dpo_export(chained, name, **training):
    root, _, recipe = chained
    recipe = json.loads(json.dumps(recipe))
    recipe["training"].update(training)
    if training:  # the destructive run: short, plain DPO (no RPO term holding the answers)
        recipe["preference"].pop("rpo_alpha")
        recipe["limits"]["max_steps"] = 10
        recipe["checkpoint"] = {"every_steps": 10, "keep": 1}
        recipe["evaluation"]["eval_every"] = 10
    path = write_recipe(root / f"{name}.json", recipe)
    return path, _trained(path, root / "inputs", root / name)


@pytest.fixture(scope="module")
def destructive(chained):
    return _dpo_export(chained, "destructive", **DESTRUCTIVE)


def _compare(chained, after, recipe_path, name):
    root, sft_export, _ = chained
    out = root / "compare" / name
    dev = {"dev": root / "inputs" / "preference-demo" / "dev.jsonl"}
    return before_after.compare(
        sft_export, after, dev, out / "before-after.json", out / "before-after.html", recipe_path
    ), out


def test_the_demo_recipe_keeps_dev_exact_match_within_its_tolerance(chained):
    path, export = _dpo_export(chained, "demo")
    tolerance = json.loads(path.read_text())["evaluation"]["max_dev_exact_match_drop"]
    record, out = _compare(chained, export, path, "demo")
    assert record["dev_exact_match_check"] == {
        "max_dev_exact_match_drop": tolerance,
        "passed": True,
    }
    assert record["after"]["dev"]["pairs"] == 100
    # the demo's claim (docs/preference.md): DPO widens the DEV margin between chosen and
    # rejected, losing no pair the SFT export ranked right
    before, after = record["before"]["dev"], record["after"]["dev"]
    assert after["mean_margin"] > before["mean_margin"]
    assert after["preference_accuracy"] >= before["preference_accuracy"]
    assert json.loads((out / "before-after.json").read_text()) == record
    assert "<b>PASS</b>" in (out / "before-after.html").read_text()


def test_a_destructive_learning_rate_is_refused_naming_both_numbers(chained, destructive):
    path, export = destructive
    with pytest.raises(before_after.DevExactMatchDrop) as refused:
        _compare(chained, export, path, "destructive")
    out = chained[0] / "compare" / "destructive"
    record = json.loads((out / "before-after.json").read_text())
    before, after = record["before"]["dev"]["exact_match"], record["after"]["dev"]["exact_match"]
    message = str(refused.value)
    assert "\n" not in message
    assert f"after {after:.4f} < before {before:.4f}" in message
    assert f"evaluation.max_dev_exact_match_drop of {path}" in message
    assert record["dev_exact_match_check"]["passed"] is False
    assert "<b>FAIL</b>" in (out / "before-after.html").read_text()


def _numpy_greedy(export, prompt: str, budget: int) -> str:
    tokenizer = Tokenizer.from_file(str(export / "tokenizer.json"))
    hf = json.loads((export / "config.json").read_text())
    stop = json.loads((export / "generation_config.json").read_text())["eos_token_id"]
    weights = load_file(export / "model.safetensors")
    ids = tokenizer.encode(f"<bos>{prompt}<sep>", add_special_tokens=False).ids
    new = []
    for _ in range(budget):
        token = int(np.argmax(reference_logits(weights, hf, ids + new)[-1]))
        if token == stop:
            break
        new.append(token)
    return tokenizer.decode(new, skip_special_tokens=True)


def test_exact_match_equals_greedy_decoding_by_the_numpy_forward(chained, destructive, tmp_path):
    """On the SFT export and on a destructive DPO export (misses as well as hits), DEV pairs
    one at a time: the measure's exact-match is NumPy's greedy decode equal to `chosen`."""
    root, sft_export, _ = chained
    _, destroyed = destructive
    rows = (root / "inputs" / "preference-demo" / "dev.jsonl").read_text().splitlines()[:12]
    seen = set()
    for export in (sft_export, destroyed):
        for number, line in enumerate(rows):
            row = json.loads(line)
            single = tmp_path / f"row{number}.jsonl"
            single.write_text(line + "\n")
            measured = before_after.figures(export, single)["exact_match"]
            want = _numpy_greedy(export, row["prompt"], len(row["chosen"]) + 4) == row["chosen"]
            assert measured == float(want), (export, row)
            seen.add(want)
    assert seen == {True, False}  # both outcomes occur, so the comparison can tell them apart
