import json

import pytest
import yaml
from conftest import linear_recipe, packed_sft_recipe, run_worker

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


# -- values the worker cannot honour are refused at validation (issue 11, defect 2) ------------

SCHEMAS = ["recipe.schema.json", "strategy-linear-momentum.schema.json",
           "strategy-packed-sft.schema.json", "strategy-two-stage.schema.json",
           "strategy-training.schema.json"]  # fmt: skip


def _leaves(schema, pointer=""):
    """Every subschema with a type, enum or const, with its location in the schema."""
    if isinstance(schema, dict):
        if "type" in schema or "enum" in schema or "const" in schema:
            yield pointer, schema
        for key, value in schema.items():
            if key not in ("default", "description", "enum"):
                yield from _leaves(value, f"{pointer}/{key}")
    elif isinstance(schema, list):
        for index, value in enumerate(schema):
            yield from _leaves(value, f"{pointer}/{index}")


@pytest.mark.parametrize("name", SCHEMAS)
def test_every_integer_number_string_and_list_in_the_schemas_is_bounded(name):
    unbounded = []
    for pointer, schema in _leaves(recipes.load_schema(name)):
        types = schema.get("type", [])
        types = [types] if isinstance(types, str) else types
        if ("integer" in types or "number" in types) and not {"maximum", "exclusiveMaximum"} & set(
            schema
        ):
            unbounded.append(f"{pointer}: no maximum")
        if "string" in types and not {"maxLength", "pattern", "enum"} & set(schema):
            unbounded.append(f"{pointer}: no maxLength or pattern")
        if "array" in types and "maxItems" not in schema:
            unbounded.append(f"{pointer}: no maxItems")
    assert not unbounded, unbounded


def sft_recipe(**overrides):
    pins = dict.fromkeys(("train", "dev", "test"), "0" * 64)
    product = {"name": "p", "version": "1"}
    return packed_sft_recipe(pins, "sft", inputs_dir="", **{"product": product, **overrides})


@pytest.mark.parametrize(
    ("recipe", "pointer", "needle"),
    [
        (linear_recipe(limits={"max_steps": 10**30}), "/limits/max_steps", "maximum of 2147483647"),
        (linear_recipe(limits={"max_steps": 2**31}), "/limits/max_steps", "maximum of 2147483647"),
        # the int32 data cursor: 2^28 updates of 8 rows is 2^31 rows, one more than it holds
        (linear_recipe(limits={"max_steps": 2**28}), "/limits/max_steps", "int32 data cursor"),
        (linear_recipe(limits={"max_steps": 8.0}), "/limits/max_steps", "not of type 'integer'"),
        (linear_recipe(limits={"deadline": "tomorrow-ish"}), "/limits/deadline", "RFC 3339"),
        (linear_recipe(limits={"deadline": "2030-01-01T00:00:00"}), "/limits/deadline", "time zone"),
        (linear_recipe(limits={"deadline": "2030-01-01"}), "/limits/deadline", "RFC 3339"),
        (linear_recipe(limits={"deadline": "2030-02-30T00:00:00Z"}), "/limits/deadline", "not a real date"),
        (linear_recipe(limits={"deadline": "2030-01-01T24:00:00Z"}), "/limits/deadline", "not a real date"),
        (linear_recipe(limits={"deadline": "0001-01-01T00:00:00+01:00"}), "/limits/deadline", "not a real date"),
        (linear_recipe(limits={"max_wall_seconds": float("inf")}), "/limits/max_wall_seconds", "finite"),
        (linear_recipe(limits={"max_compute_seconds": 1e10}), "/limits/max_compute_seconds", "maximum"),
        (linear_recipe(training={"learning_rate": float("nan")}), "/training/learning_rate", "finite"),
        (linear_recipe(training={"seed": 2**32}), "/training/seed", "maximum of 4294967295"),
        (linear_recipe(training={"seed": 10**5000}), "/training/seed", "out of range"),
        (linear_recipe(evaluation={"heldout_x": [0.0, 1e300]}), "/evaluation/heldout_x/1", "maximum"),
        (linear_recipe(evaluation={"heldout_x": [0.0] * 100001}), "/evaluation/heldout_x", "too long"),
        (linear_recipe(checkpoint={"every_steps": 2**31}), "/checkpoint/every_steps", "maximum"),
        (linear_recipe(checkpoint={"keep": 10**7}), "/checkpoint/keep", "maximum"),
        (linear_recipe(runtime={"min_devices": 10**6}), "/runtime/min_devices", "maximum"),
        (linear_recipe(product={"name": "a\nb", "version": "1"}), "/product/name", "pattern"),
        (linear_recipe(product={"name": "x" * 201, "version": "1"}), "/product/version", None),
        (linear_recipe(inputs=[{"name": "examples", "path": "a\x00b", "sha256": "0" * 64}]), "/inputs/0/path", "pattern"),
        (linear_recipe(inputs=[{"name": "examples", "url": "https://x/y", "size": 2**53, "sha256": "0" * 64}]), "/inputs/0/size", "maximum"),
        (linear_recipe(inputs=[{"name": f"i{i}", "path": "p", "sha256": "0" * 64} for i in range(65)]), "/inputs", "too long"),
        (linear_recipe(strategy={"name": "linear-momentum", "version": "1" * 10 + ".0.0"}), "/strategy/version", "pattern"),
        (sft_recipe(training={"eps": 1e-50}), "/training/eps", "minimum"),
        (sft_recipe(training={"weight_decay": 1e39}), "/training/weight_decay", "maximum"),
        (sft_recipe(training={"seed": 2**32}), "/training/seed", "maximum"),
        (sft_recipe(model={"d_model": 2**20}), "/model/d_model", "maximum"),
        (sft_recipe(evaluation={"eval_every": 2**31}), "/evaluation/eval_every", "maximum"),
        (sft_recipe(model={"tokenizer": {"kind": "tokenizers-json", "special_tokens": {"pad": ""}}}), "/model/tokenizer/special_tokens/pad", "non-empty"),
    ],
)  # fmt: skip
def test_values_the_worker_cannot_honour_are_refused_with_their_pointer(recipe, pointer, needle):
    if pointer == "/product/version":  # the name is too long; the version is fine
        pointer, needle = "/product/name", "too long"
    with pytest.raises(recipes.RecipeError) as info:
        recipes.validate(recipe)
    found = {e["path"]: e["message"] for e in info.value.errors}
    assert pointer in found, found
    assert needle in found[pointer], found[pointer]


@pytest.mark.parametrize(
    ("inputs", "pointer"),
    [(None, "/inputs"), (7, "/inputs"), ([{"name": ["x"], "path": "p", "sha256": "0" * 64}], "/inputs/0/name")],
)  # fmt: skip
def test_malformed_inputs_are_a_recipe_error_not_a_crash(inputs, pointer):
    with pytest.raises(recipes.RecipeError) as info:
        recipes.validate(linear_recipe(inputs=inputs))
    assert pointer in {e["path"] for e in info.value.errors}


def test_the_largest_representable_values_are_accepted():
    recipes.validate(linear_recipe(limits={"max_steps": 2**31 // 8 - 1}))
    recipes.validate(linear_recipe(training={"seed": 2**32 - 1}))
    recipes.validate(linear_recipe(limits={"deadline": "2030-01-01T02:00:00.123456+02:00"}))
    recipes.validate(linear_recipe(limits={"deadline": "9999-12-31T23:59:59Z"}))


def test_an_unquoted_yaml_timestamp_is_named(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(linear_recipe()) + "limits:\n  deadline: 2030-01-01T00:00:00Z\n")
    with pytest.raises(recipes.RecipeError) as info:
        recipes.load(path)
    assert info.value.errors == [
        {
            "path": "/limits/deadline",
            "message": "is a YAML timestamp; quote it so it stays text, e.g. "
            "deadline: '2030-01-01T00:00:00Z'",
        }
    ]


@pytest.mark.parametrize(
    ("name", "content", "needle"),
    [
        ("r.yaml", b"\xff\xfe", "not UTF-8"),
        ("r.json", b"\xff\xfe", "not UTF-8"),
        ("r.json", b'{"job_id": ' + b"9" * 5000 + b"}", "not valid JSON"),
        ("r.json", b"[" * 100000, "not valid JSON"),
        ("r.json", b" " * (recipes.MAX_RECIPE_BYTES + 1), "larger than"),
    ],
)
def test_unreadable_files_are_a_recipe_error(tmp_path, name, content, needle):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(recipes.RecipeError) as info:
        recipes.load(path)
    assert info.value.errors[0]["path"] == "" and needle in info.value.errors[0]["message"]
    assert name in str(info.value)


BAD_FILES = {
    "steps.json": json.dumps(linear_recipe(limits={"max_steps": 10**30})).encode(),
    "deadline.json": json.dumps(linear_recipe(limits={"deadline": "tomorrow-ish"})).encode(),
    "nan.json": b'{"job_id": "j", "product": {"name": "p", "version": "1"}, '
    b'"strategy": {"name": "linear-momentum", "version": "1.0.0"}, '
    b'"training": {"learning_rate": NaN}}',
    "bytes.yaml": b"\xff\xfe",
}
POINTERS = {
    "steps.json": '"/limits/max_steps"',
    "deadline.json": '"/limits/deadline"',
    "nan.json": '"/training/learning_rate"',
    "bytes.yaml": "UTF-8",
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_worker_refuses_bad_recipes_with_exit_2_and_no_traceback(tmp_path, name):
    job = tmp_path / name
    job.write_bytes(BAD_FILES[name])
    (tmp_path / "in").mkdir()
    check = run_worker("--job", job, "--validate-only")
    assert check.returncode == 2, check.stderr
    verdict = json.loads(check.stdout)
    assert verdict["valid"] is False and POINTERS[name].strip('"') in json.dumps(verdict)
    assert "Traceback" not in check.stderr
    # a run is refused the same way, before anything is written
    out = tmp_path / "out"
    run = run_worker("--job", job, "--input-root", tmp_path / "in", "--output-root", out)
    assert run.returncode == 2
    assert POINTERS[name].strip('"') in run.stderr and "Traceback" not in run.stderr
    assert not out.exists()


# -- the training block packed-sft and two-stage share by $ref ---------------------------------


@pytest.mark.parametrize("strategy", ["packed-sft", "two-stage"])
def test_the_shared_training_block_fills_its_defaults_and_refuses_unknown_keys(strategy):
    """Both strategies get the training defaults the shared schema states (read from the file
    here, not from the code under test), and a misspelt training key is still refused."""
    import json
    from pathlib import Path

    import minifield

    shared = json.loads(
        (Path(minifield.__file__).parent / "schemas" / "strategy-training.schema.json").read_text()
    )["properties"]
    expected = {k: p["default"] for k, p in shared.items() if "default" in p}
    nested = shared["data_parallel"]["properties"]
    expected["data_parallel"] = {k: p["default"] for k, p in nested.items()}
    assert expected["learning_rate"] == 0.003 and expected["warmup_steps"] == 20
    version = "12.0.0" if strategy == "packed-sft" else "11.0.0"
    training = {} if strategy == "packed-sft" else {"stage": "sft"}
    recipe = sft_recipe(strategy={"name": strategy, "version": version}, training=training)
    filled = recipes.validate(recipe).data["training"]
    assert {k: filled.get(k) for k in expected} == expected
    recipe["training"] = {**training, "learning_rat": 0.1}
    with pytest.raises(recipes.RecipeError) as info:
        recipes.validate(recipe)
    found = {e["path"]: e["message"] for e in info.value.errors}
    assert "'learning_rat' was unexpected" in found["/training"], found
    assert "check the spelling" in found["/training"]


def test_each_strategy_validates_by_the_schema_titled_with_its_name_and_version():
    """A strategy's schema file follows from its name; the file's own title says whose it is."""
    from minifield import schemas, strategies

    for strategy in strategies.available():
        title = schemas.load(strategy.schema_file)["title"]
        assert title.startswith(f"{strategy.name} {strategy.version}: "), (strategy.name, title)
