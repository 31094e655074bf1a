"""The preference demo, reduced, through real Snakemake: the Llama SFT demo (four updates on a
slice of its data), then DPO on a slice of the demo's near-miss pairs chained after its
export, with the reference computed as a product and pinned; the preference computation is
proven, trained, evaluated and published under its own digest, and the before/after record
compares the SFT export and the DPO export on the same pairs. Its preference accuracy is
checked against the float64 NumPy forward of tests/family_reference.py on the exported
weights, the prompt tokenized here from the template's layout (`<bos>prompt<sep>`). The run
is the config's whole run, report pages included, and a rerun with the same config does
nothing."""

import hashlib
import json
import re
import shutil

import numpy as np
import pytest
import yaml
from conftest import REPO, copy_demo_heads, run_snakemake
from family_reference import reference_logits
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from minifield.pipeline import reference_logprobs

# runs Snakemake; a demo as users run it, compiled as production does (conftest)
pytestmark = [pytest.mark.slow, pytest.mark.production_compile]

SLICES = {"llama-sft-demo": (40, 8, 8), "preference-demo": (16, 8, 8)}


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _tiny(path, project, **evaluation):
    recipe = yaml.safe_load(path.read_text())
    recipe["training"].update(batch_size=4, warmup_steps=1)
    recipe["limits"] = {"max_steps": 4}
    recipe["checkpoint"] = {"every_steps": 2, "keep": 2}
    recipe["evaluation"] = {"eval_every": 2, **evaluation}
    for item in recipe["inputs"]:
        if item["name"] != "reference":
            item["sha256"] = _sha(project / "data" / item["path"])
    return recipe


def make_project(tmp_path):
    shutil.copytree(REPO / "data" / "llama-base", tmp_path / "data" / "llama-base")
    for part, sizes in SLICES.items():
        lines = dict(zip(("train", "dev", "test"), sizes, strict=True))
        copy_demo_heads(REPO / "data" / part, tmp_path / "data" / part, lines)
    (tmp_path / "config" / "recipes").mkdir(parents=True)
    for name, evaluation in (
        ("llama-sft-demo", {}),
        # four updates: acceptance is not what this test is about (the gate: the worker tests)
        ("preference-demo", {"min_dev_preference_accuracy": 0.0, "max_dev_exact_match_drop": 0.0}),
    ):
        recipe = _tiny(REPO / "config" / "recipes" / f"{name}.yaml", tmp_path, **evaluation)
        (tmp_path / "config" / "recipes" / f"{name}.yaml").write_text(yaml.safe_dump(recipe))
    config = yaml.safe_load((REPO / "config" / "preference.yaml").read_text())
    config.update(qualification={"mode": "crash"})  # test_proof.py covers both modes
    (tmp_path / "config" / "preference.yaml").write_text(yaml.safe_dump(config))
    return tmp_path


def numpy_preference(export, pairs) -> tuple[float, float]:
    """Preference accuracy and mean margin, each answer scored through its end-of-turn token
    (`answer<eos>`, the template's assistant turn)."""
    tokenizer = Tokenizer.from_file(str(export / "tokenizer.json"))
    hf = json.loads((export / "config.json").read_text())
    weights = load_file(export / "model.safetensors")

    def logp(prompt, answer):
        head = tokenizer.encode(f"<bos>{prompt}<sep>", add_special_tokens=False).ids
        ids = head + tokenizer.encode(f"{answer}<eos>", add_special_tokens=False).ids
        logits = np.asarray(reference_logits(weights, hf, ids), np.float64)
        top = logits.max(-1, keepdims=True)
        lp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
        return sum(lp[t - 1, ids[t]] for t in range(len(head), len(ids)))

    margins = [logp(p["prompt"], p["chosen"]) - logp(p["prompt"], p["rejected"]) for p in pairs]
    return float(np.mean(np.asarray(margins) > 0)), float(np.mean(margins))


def test_dpo_chained_after_sft_with_its_reference_and_the_before_after_record(tmp_path):
    project = make_project(tmp_path)
    configfile = ("--configfile", "config/preference.yaml")
    sft = reference_logprobs.validated(project / "config" / "recipes" / "llama-sft-demo.yaml")
    written = reference_logprobs.validated(project / "config" / "recipes" / "preference-demo.yaml")
    a, b = sft.computation_digest[:16], written.computation_digest[:16]

    # the config's whole run, as a user makes it: the links, the reference, both computations
    # through their proofs, training, evaluation and publication, the before/after record,
    # the capacity plan and the report pages, the outcome page last
    chain_dir = project / "results" / "chains" / a / b
    run = run_snakemake(project, *configfile, check=True)
    (link_dir,) = (project / "results" / "preference").glob("*/*")
    c = reference_logprobs.validated(link_dir / "recipe.json").computation_digest[:16]
    ran = re.findall(r"Finished jobid: \d+ \(Rule: (\w+)\)", run.stdout + run.stderr)
    for rule, count in (("chain_link", 1), ("reference", 1), ("reference_link", 1), ("train", 2)):
        assert ran.count(rule) == count, (rule, ran)
    assert ran.count("report_outcome") == 1, ran
    chained = json.loads((chain_dir / "recipe.json").read_text())
    final = json.loads((link_dir / "recipe.json").read_text())
    sft_export = project / "results" / "computations" / a / "train" / "export"
    pins = {i["name"]: i["sha256"] for i in final["inputs"]}
    # the DPO recipe starts from the SFT export and pins the reference product
    assert pins["base-weights"] == _sha(sft_export / "model.safetensors")
    (product,) = (project / "results" / "reference").glob("*/reference.safetensors")
    assert pins["reference"] == _sha(product)
    assert {i["name"] for i in chained["inputs"]} == {i["name"] for i in final["inputs"]} - {
        "reference"
    }
    cdir = project / "results" / "computations" / c
    assert json.loads((cdir / "qualification" / "proof.json").read_text())["passed"] is True
    metrics = json.loads((cdir / "eval" / "metrics.json").read_text())
    assert 0.0 <= metrics["selected_dev"]["dev_preference_accuracy"] <= 1.0
    assert (cdir / "publication.json").is_file()

    record = json.loads((chain_dir / "before-after.json").read_text())
    assert (chain_dir / "report" / "before-after.html").is_file()
    dev = [
        json.loads(line)
        for line in (project / "data" / "preference-demo" / "dev.jsonl").read_text().splitlines()
    ]
    assert record["after"]["dev"]["pairs"] == len(dev) == 8
    for key, export in (("after", cdir / "train" / "export"), ("before", sft_export)):
        accuracy, margin = numpy_preference(export, dev)
        assert record[key]["dev"]["preference_accuracy"] == accuracy
        assert record[key]["dev"]["mean_margin"] == pytest.approx(margin, abs=1e-4)
    # the check's wiring: the tolerance read from the DPO recipe, the verdict in the report
    # (four SFT updates exact-match no DEV pair: nothing to lose; test_before_after.py refuses
    # a real drop)
    assert record["before"]["dev"]["exact_match"] == 0.0
    assert record["dev_exact_match_check"] == {"max_dev_exact_match_drop": 0.0, "passed": True}
    assert "<b>PASS</b>" in (chain_dir / "report" / "before-after.html").read_text()
    # run again with the same config: nothing to do (the outcome page's inputs are the same
    # list once the links exist)
    again = run_snakemake(project, *configfile, "-n", check=True)
    assert "Nothing to be done" in again.stdout + again.stderr
