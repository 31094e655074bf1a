import json

import pytest
import yaml
from conftest import linear_recipe

from minifield import recipe as recipes


def test_defaults_are_filled_before_the_digest():
    bare = recipes.validate(linear_recipe())
    assert bare.data["training"] == {
        "seed": 3,
        "learning_rate": 0.04,
        "momentum": 0.8,
        "batch_size": 8,
    }
    assert bare.data["limits"]["max_steps"] == 8
    assert bare.data["checkpoint"]["every_steps"] == 2
    spelled = recipes.validate(
        linear_recipe(training={"seed": 3, "learning_rate": 0.04, "momentum": 0.8, "batch_size": 8})
    )
    assert spelled.computation_digest == bare.computation_digest


def test_three_mistakes_are_all_reported_with_pointers():
    bad = linear_recipe(
        training={"momentum": 1.2, "batch_size": 65},
        inputs=[{"name": "examples", "path": "linear/examples.jsonl"}],
    )
    with pytest.raises(recipes.RecipeError) as info:
        recipes.validate(bad)
    paths = {e["path"] for e in info.value.errors}
    assert {"/training/momentum", "/training/batch_size", "/inputs/0/sha256"} <= paths
    assert all(e["message"] for e in info.value.errors)


def test_identity_and_operational_fields_do_not_change_the_digest():
    base = recipes.validate(linear_recipe())
    other = recipes.validate(
        linear_recipe(
            job_id="another-job",
            attempt_id="a-7",
            limits={
                "max_wall_seconds": 5,
                "deadline": "2030-01-01T00:00:00Z",
                "max_compute_seconds": 9,
            },
            checkpoint={"every_steps": 4, "keep": 1},
            runtime={"backend": "cpu"},
        )
    )
    assert other.computation_digest == base.computation_digest


def test_learning_rate_and_step_limit_change_the_digest_but_not_the_data_digest():
    base = recipes.validate(linear_recipe())
    faster = recipes.validate(linear_recipe(training={"learning_rate": 0.05}))
    longer = recipes.validate(linear_recipe(limits={"max_steps": 9}))
    assert len({base.computation_digest, faster.computation_digest, longer.computation_digest}) == 3
    assert base.examples_digest == faster.examples_digest == longer.examples_digest


def test_yaml_and_json_recipes_are_the_same_computation(tmp_path):
    data = linear_recipe(training={"learning_rate": 0.03})
    (tmp_path / "r.json").write_text(json.dumps(data))
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(data))
    assert (
        recipes.load(tmp_path / "r.json").computation_digest
        == recipes.load(tmp_path / "r.yaml").computation_digest
    )


@pytest.mark.parametrize("path", ["/etc/passwd", "../outside.jsonl", "a/../../b"])
def test_input_paths_cannot_escape_the_input_root(path):
    with pytest.raises(recipes.RecipeError) as info:
        recipes.validate(
            linear_recipe(inputs=[{"name": "examples", "path": path, "sha256": "0" * 64}])
        )
    assert info.value.errors[0]["path"] == "/inputs/0/path"


def test_unknown_strategy_and_unknown_keys_are_named():
    with pytest.raises(recipes.RecipeError) as info:
        recipes.validate(
            linear_recipe(strategy={"name": "nope", "version": "1.0.0"}, trainig={"seed": 1})
        )
    messages = " ".join(e["path"] + " " + e["message"] for e in info.value.errors)
    assert "unknown strategy nope 1.0.0" in messages
    assert "trainig" in messages


def test_unparseable_file_names_the_file(tmp_path):
    bad = tmp_path / "broken.yaml"
    bad.write_text("job_id: [unclosed")
    with pytest.raises(recipes.RecipeError) as info:
        recipes.load(bad)
    assert "broken.yaml" in str(info.value)
