"""What a run did, per computation (the closing summary the run prints and the report's first
item): read from the files the stages wrote, each failing acceptance check with its value."""

from __future__ import annotations

import json

from minifield.observe.report import outcome

CONTENT_ID = "ab" * 32


def _write(path, value):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value))


def _computation(results, cdigest, *, accepted, current=None):
    cdir = results / cdigest
    _write(cdir / "recipe.json", {"job_id": "mine"})
    _write(cdir / "train" / "result.json", {"status": "completed", "steps_completed": 4})
    _write(cdir / "qualification" / "proof.json", {"passed": True})
    checks = [
        {"name": "dev_exact_match", "value": 0.25, "threshold": 0.5, "passed": accepted},
        {"name": "dev_loss", "value": 1.5, "threshold": 2.0, "passed": True},
    ]
    _write(cdir / "eval" / "metrics.json", {"acceptance": {"passed": accepted, "checks": checks}})
    _write(cdir / "publication.json", {"content_id": CONTENT_ID, "activated": False})
    return cdir


def test_a_failed_acceptance_names_the_check_and_is_published_not_activated(tmp_path):
    results, store = tmp_path / "results" / "computations", tmp_path / "store"
    _computation(results, "0123456789abcdef", accepted=False)
    (line,) = outcome.closing_summary(["0123456789abcdef"], results, store)
    assert line == (
        "mine (0123456789abcdef): trained (4 updates); recovery proof passed; acceptance "
        "FAILED: dev_exact_match 0.25 (threshold 0.5); published abababababababab, not "
        "activated (activation refuses a model that fails acceptance)"
    )


def test_an_activated_model_and_missing_stages_are_said(tmp_path):
    results, store = tmp_path / "results" / "computations", tmp_path / "store"
    _computation(results, "0123456789abcdef", accepted=True)
    _write(store / "active.json", {"current": CONTENT_ID, "previous": None})
    _write(results / "fedcba9876543210" / "recipe.json", {"job_id": "other"})
    lines = outcome.closing_summary(
        ["0123456789abcdef", "fedcba9876543210", "0123456789abcdef", "1111111111111111"],
        results,
        store,
    )
    assert lines == [
        "mine (0123456789abcdef): trained (4 updates); recovery proof passed; acceptance "
        "passed; published abababababababab, activated (the store's current model)",
        "other (fedcba9876543210): not trained (no train/result.json); no recovery proof; "
        "not evaluated (no eval/metrics.json); not published",
    ]


def test_the_report_item_lists_the_computations_of_its_inputs(tmp_path):
    paths = [
        "results/computations/0123456789abcdef/eval/metrics.json",
        "results/computations/0123456789abcdef/publication.json",
        "results/chains/aa/bb/recipe.yaml",
        "results/computations/fedcba9876543210/eval/metrics.json",
    ]
    assert outcome.computations_in(paths) == ["0123456789abcdef", "fedcba9876543210"]
    out = tmp_path / "outcome.html"
    outcome.outcome_page(["mine (0123456789abcdef): a <b> line"], out)
    assert "<li>mine (0123456789abcdef): a &lt;b&gt; line</li>" in out.read_text()
