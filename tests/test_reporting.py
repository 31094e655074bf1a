"""Report items from small hand-written result files (no pipeline run)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from minifield.observe.report import results, training

H = {c: c * 64 for c in "abcdef"}  # readable fake sha256 strings


def write(path: Path, value) -> Path:
    path.write_text(json.dumps(value))
    return path


def test_recovery_table_compares_hash_sequences_and_flags_divergence(tmp_path):
    proof = write(
        tmp_path / "proof.json",
        {
            "passed": False,
            "reference_state_hashes": [H["a"], H["b"], H["c"]],
            "resumed_state_hashes": [H["a"], H["b"], H["d"]],
            "first_divergence": {"step": 3},
            "checkpoint": {"step": 2, "sha256": H["e"]},
            "diagnosis": "state differs after update 3",
        },
    )
    out = tmp_path / "recovery.html"
    results.recovery_table(proof, out)
    page = out.read_text()
    assert "FAILED" in page
    assert page.count(">equal<") == 2 and page.count(">DIFFERENT<") == 1
    assert "state differs after update 3" in page and "first_divergence.step" in page


def test_missing_optional_inputs_say_which_rule_is_absent(tmp_path):
    for function, rule in [
        (results.recovery_table, "qualify"),
        (results.publication_table, "publish"),
        (results.capacity_table, "capacity_table"),
    ]:
        out = tmp_path / f"{rule}.html"
        function(None, out)
        assert f"no <code>{rule}</code> rule" in out.read_text()


def test_capacity_and_publication_tables_show_the_records(tmp_path):
    csv_path = tmp_path / "capacity.csv"
    csv_path.write_text("scenario,seconds_per_job,min_workers_with_reserve\nmeasured,12.5,2\n")
    out = tmp_path / "capacity.html"
    results.capacity_table(csv_path, out)
    page = out.read_text()
    assert "<th>min_workers_with_reserve</th>" in page and '<td class="num">12.5</td>' in page
    assert "hypothetical" in page.lower() or "assumptions" in page
    record = write(
        tmp_path / "publication.json",
        {"content_id": H["f"], "provenance": {"recipe_digest": H["a"]}, "active": True},
    )
    out = tmp_path / "publication.html"
    results.publication_table(record, out)
    page = out.read_text()
    assert H["f"] in page and "provenance.recipe_digest" in page and ">yes<" in page


def test_evaluation_table_marks_the_dev_selected_checkpoint(tmp_path):
    metrics = write(
        tmp_path / "metrics.json",
        {
            "checkpoints": [
                {"step": 2, "sha256": H["a"], "state_hash": H["b"], "dev": {"loss": 3.0}},
                {"step": 4, "sha256": H["c"], "state_hash": H["d"], "dev": {"loss": 1.5}},
            ],
            "selection": {
                "split": "dev",
                "metric": "loss",
                "mode": "min",
                "step": 4,
                "sha256": H["c"],
            },
            "test": {"loss": 1.75},
            "acceptance": {
                "passed": True,
                "checks": [{"name": "loss", "value": 1.5, "threshold": 2.0, "passed": True}],
            },
        },
    )
    out = tmp_path / "evaluation.html"
    results.evaluation_table(metrics, out)
    page = out.read_text()
    selected = page.split('<tr class="selected">')[1].split("</tr>")[0]
    assert '<td class="num">4</td>' in selected and "DEV-selected" in selected
    assert page.count('<tr class="selected">') == 1
    assert '<td class="num">1.75</td>' in page  # TEST of the selected checkpoint


def test_goodput_chart_and_throughput_table_from_a_summary(tmp_path):
    attempt = {
        "attempt_id": "a1",
        "status": "completed",
        "wall_s": 4.0,
        "update_s": 1.5,
        "redone_update_s": 0.0,
        "compile_s": 0.5,
        "checkpoint_s": 0.25,
        "evaluation_s": 0.25,
        "updates_count": 4,
        "redone_updates_count": 0,
        "restored_step_count": None,
        "first_update_step_count": 1,
        "completed_steps_count": 4,
        "uncheckpointed_updates_count": 0,
    }
    goodput = {
        "productive_update_s": 1.5,
        "redone_update_s": 0.0,
        "compile_s": 0.5,
        "checkpoint_s": 0.25,
        "evaluation_s": 0.25,
        "between_attempts_s": 0.0,
        "other_s": 1.5,
        "productive_fraction": 0.375,
    }
    summary = write(
        tmp_path / "summary.json",
        {
            "attempts": [attempt],
            "goodput": goodput,
            "restarts": {},
            "job_wall_time_s": 4.0,
            "update_duty_fraction": 0.375,
            "note": "update_duty_fraction ... is not hardware utilization.",
        },
    )
    training.plot_goodput(summary, tmp_path / "goodput.png")
    assert (tmp_path / "goodput.png").read_bytes().startswith(b"\x89PNG")
    training.throughput_table(summary, tmp_path / "throughput.html")
    page = (tmp_path / "throughput.html").read_text()
    assert "update_duty_fraction" in page and "not hardware utilization" in page
    assert '<td class="num">0.375</td>' in page
    # each field's unit, as its name says it (observe.summarize's naming rule)
    for field, unit in [
        ("final_status", ""),
        ("update_duty_fraction", "fraction"),
        ("job_tokens_per_s", "tokens/s"),
        ("job_productive_examples_per_s", "examples/s"),
        ("job_wall_time_s", "s"),
        ("restarts.lost_uncheckpointed_updates_count", "count"),
        ("restarts.lost_s", "s"),
    ]:
        assert re.search(f"<td>{re.escape(field)}</td><td[^>]*>[^<]*</td><td>{unit}</td>", page)


def test_recovery_table_shows_the_proofs_own_comparison(tmp_path):
    proof = write(
        tmp_path / "proof.json",
        {
            "passed": True,
            "diagnosis": "Recovery reproduced the computation exactly.",
            "comparison": [
                {
                    "step": 2,
                    "what": "restored checkpoint",
                    "reference": H["a"],
                    "resumed": H["a"],
                    "equal": True,
                },
                {
                    "step": 3,
                    "what": "update",
                    "reference": H["b"],
                    "resumed": H["b"],
                    "equal": True,
                },
            ],
            "checkpoint_used": {"step": 2, "sha256": H["c"], "verified": True},
            "first_divergence": None,
        },
    )
    out = tmp_path / "recovery.html"
    results.recovery_table(proof, out)
    page = out.read_text()
    assert "passed" in page and "reproduced the computation exactly" in page
    assert "<th>what</th>" in page and page.count(">restored checkpoint<") == 1
    assert "checkpoint_used.step" in page and "first_divergence" in page
    assert "comparison[0]" not in page  # shown as the table, not again as flat rows


def test_evaluation_table_shows_harness_results_and_their_threshold_checks(tmp_path):
    metrics = write(
        tmp_path / "metrics.json",
        {
            "checkpoints": [{"step": 4, "sha256": H["c"], "state_hash": H["d"], "dev": {}}],
            "selection": {"metric": "loss", "mode": "min", "step": 4, "sha256": H["c"]},
            "harness": {
                "results": {"reverse_mc": {"acc": 0.625}},
                "samples": {"reverse_mc": 24},
                "settings": {"limit": None},
                "lm_eval_version": "0.4.13",
            },
            "acceptance": {
                "passed": False,
                "checks": [
                    {
                        "name": "harness:reverse_mc/acc",
                        "value": 0.625,
                        "threshold": 0.7,
                        "passed": False,
                    }
                ],
            },
        },
    )
    out = tmp_path / "evaluation.html"
    results.evaluation_table(metrics, out)
    page = out.read_text()
    harness = page.split("lm-evaluation-harness tasks")[1].split("<h2>")[0]
    assert "reverse_mc" in harness and '<td class="num">0.625</td>' in harness
    assert '<td class="num">24</td>' in harness
    assert "harness:reverse_mc/acc" in page.split("Acceptance")[1] and "FAILED" in page
