"""The workflow config checked before Snakemake reads it: a bad value is named by file and
field with what it must be, exit 2; and ``evaluate.processes`` (the evaluate stage over
several processes) refused where the recipe's computation is on one device."""

from __future__ import annotations

import pytest
import yaml
from conftest import REPO, linear_recipe, run_snakemake, write_recipe
from snakemake.utils import validate

from minifield.pipeline import evaluation, workflow_config
from minifield.pipeline.computations import ConfigError
from minifield.pipeline.errors import StageError

SOURCE = ["config/config.yaml"]


def test_a_bad_evaluate_processes_is_named_by_file_field_and_expectation():
    for value, expectation in ((0, "0 is less than the minimum of 1"),
                               ("two", "'two' is not of type 'integer'"),
                               (1.5, "1.5 is not of type 'integer'")):  # fmt: skip
        found = workflow_config.problems(
            {"recipes": ["r.yaml"], "evaluate": {"processes": value}}, SOURCE
        )
        assert found == [f"config/config.yaml: evaluate.processes: {expectation}"]


def test_config_files_are_named_as_snakemake_gives_them_paths_included():
    """``workflow.configfiles`` holds paths for the ``--configfile`` ones."""
    from pathlib import Path

    sources = ["config/config.yaml", Path("config/mine.yaml")]
    assert workflow_config.problems({"recipes": ["r.yaml"]}, sources) == []
    found = workflow_config.problems({"recipes": ["r.yaml"], "evaluate": {"processes": 0}}, sources)
    assert found == [
        "config/config.yaml, config/mine.yaml: evaluate.processes: 0 is less than the minimum of 1"
    ]


def test_a_misspelt_key_and_a_missing_one_are_named():
    found = workflow_config.problems({"evaluate": {"procesess": 2}}, SOURCE)
    assert found == [
        "config/config.yaml: evaluate: Additional properties are not allowed ('procesess' was "
        "unexpected) (check the spelling against config/README.md)",
        "config/config.yaml: recipes: 'recipes' is a required property",
    ]
    with pytest.raises(ConfigError, match="evaluate: Additional properties"):
        workflow_config.check({"recipes": ["r.yaml"], "evaluate": {"procesess": 2}}, SOURCE)


def test_the_snakefile_check_exits_2_with_one_message_and_no_traceback(capsys):
    with pytest.raises(SystemExit) as ended:
        workflow_config.require_valid({"recipes": ["r.yaml"], "evaluate": {"processes": 0}}, SOURCE)
    assert ended.value.code == 2
    err = capsys.readouterr().err
    assert err == (
        "minifield: invalid workflow config:\n"
        "config/config.yaml: evaluate.processes: 0 is less than the minimum of 1\n"
    )


def test_the_shipped_config_is_valid_and_evaluate_processes_defaults_to_1():
    shipped = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    assert workflow_config.problems(shipped, SOURCE) == []
    assert workflow_config.problems({"recipes": ["r.yaml"], "evaluate": {"processes": 4}}, []) == []
    # the default comes from the schema alone, filled in as the Snakefile's validate does
    config = {"recipes": ["r.yaml"]}
    validate(config, schema=str(REPO / "workflow" / "schemas" / "config.schema.json"))
    assert config["evaluate"] == {"processes": 1}


def test_several_evaluation_processes_for_a_one_device_computation_are_refused(tmp_path):
    """Refused before any process starts or anything is read (the train result does not
    exist), naming the setting and the recipe."""
    from minifield.pipeline import preparation

    job = write_recipe(tmp_path / "job.json", linear_recipe())
    preparation.validate(job, tmp_path / "recipe.json", tmp_path / "validation.json")
    with pytest.raises(StageError, match=r"evaluate.processes is 2 .* linear-test .* one device"):
        evaluation.evaluate(
            tmp_path / "recipe.json", tmp_path / "absent-result.json", tmp_path / "examples",
            tmp_path / "eval" / "metrics.json", processes=2,
        )  # fmt: skip
    assert not (tmp_path / "eval").exists()


@pytest.mark.slow  # a Snakemake process
def test_snakemake_stops_on_a_bad_value_with_exit_2_before_any_rule(tmp_path):
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "config.yaml").write_text(
        "recipes: [config/recipes/r.yaml]\nevaluate: {processes: 0}\n"
    )
    proc = run_snakemake(tmp_path, "-n")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "config/config.yaml: evaluate.processes: 0 is less than the minimum of 1" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not (tmp_path / "results").exists()
