"""The built-in rewards on hand-written completions with values worked out by hand, the recipe
entry's one spelling (:func:`rewards.normalize`) and its schema. No process is started here:
the python reward runs for real in tests/test_rl_python_reward.py."""

from __future__ import annotations

import copy

import jsonschema
import numpy as np
import pytest

from minifield import recipe, schemas
from minifield.rl import rewards
from minifield.rl.rewards import RewardError, final_answer


def _score(reward: dict, completions: list[str], column=None, lengths=None, update=0):
    """One built-in reward's values (the entry normalised first)."""
    entries = [dict(reward)]
    assert rewards.normalize(entries, []) == []
    columns = {} if column is None else {entries[0]["column"]: column}
    ids = [[7] * n for n in lengths] if lengths else [[7]] * len(completions)
    values = rewards.score(
        entries,
        prompts=["p"] * len(completions),
        completions=completions,
        completion_ids=ids,
        columns=columns,
        update=update,
        files={},
    )
    [(name, array)] = values.items()
    assert name == entries[0]["name"] and array.dtype == np.float64
    return array.tolist()


# -- the final answer -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, answer",
    [
        ("<answer>42</answer>", "42"),
        # the last of several answer tags
        ("<answer>1</answer> no wait <answer>2</answer>", "2"),
        # not normalised here: the exact text between the tags
        ("so <answer>\n  Paris \t</answer>\n", "\n  Paris \t"),
        # an answer tag wins over \boxed, wherever it is
        ("\\boxed{3} <answer>4</answer>", "4"),
        ("<answer>4</answer> and \\boxed{3}", "4"),
        # the opening tag nearest before the last closing one
        ("<answer>a<answer>b</answer>", "b"),
        # nested braces inside \boxed
        ("so x = \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
        ("\\boxed{{a}{b{c}}} end", "{a}{b{c}}"),
        # the last \boxed; a \boxed inside another is part of the outer one
        ("\\boxed{1} then \\boxed{2}", "2"),
        ("\\boxed{\\boxed{5}}", "\\boxed{5}"),
        # escaped braces are literal braces, not nesting
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
        # ... even unbalanced: an escaped closing brace does not close, an escaped opening
        # one does not open
        ("\\boxed{a\\}b} c", "a\\}b"),
        ("\\boxed{\\{} c", "\\{"),
        # an unclosed \boxed (cut at the token limit) is skipped
        ("\\boxed{1} then \\boxed{2", "1"),
        # an unclosed answer tag does not count; \boxed is next
        ("<answer>5 and \\boxed{6}", "6"),
        # neither: the whole completion
        ("just 7", "just 7"),
        ("</answer> <answer>9", "</answer> <answer>9"),
        ("\\boxed{2", "\\boxed{2"),
    ],
)
def test_final_answer(text, answer):
    assert final_answer(text) == answer


# -- exact_match ----------------------------------------------------------------------------------


def test_exact_match_normalises_whitespace_and_converts_the_column_with_str():
    completions = [
        "The capital is <answer>  Paris \n</answer>",
        "<answer>paris</answer>",
        "\\boxed{ Paris \t  France }",
        "Paris",
        "<answer>42</answer>",
        "<answer>42.0</answer>",
        "<answer>4 2</answer>",
    ]
    column = ["Paris", "Paris", "Paris France", "  Paris\n", 42, 42, 42]
    assert _score({"kind": "exact_match", "column": "answer"}, completions, column) == [
        1.0,
        0.0,  # case counts by default
        1.0,
        1.0,
        1.0,
        0.0,  # "42.0" is not "42": text, not numbers
        0.0,
    ]


def test_exact_match_ignore_case_casefolds():
    completions = ["<answer>paris</answer>", "<answer>STRASSE</answer>", "<answer>Rome</answer>"]
    column = ["PARIS", "straße", "Paris"]
    reward = {"kind": "exact_match", "column": "answer", "ignore_case": True}
    assert _score(reward, completions, column) == [1.0, 1.0, 0.0]


def test_a_column_the_rows_lack_names_the_reward_and_the_update():
    entries = [{"kind": "exact_match", "column": "answer", "name": "correct"}]
    assert rewards.normalize(entries, []) == []
    with pytest.raises(RewardError, match=r"reward correct at update 12: .*no column 'answer'"):
        rewards.score(
            entries,
            prompts=["p"],
            completions=["x"],
            completion_ids=[[1]],
            columns={"solution": ["x"]},
            update=12,
            files={},
        )


# -- numeric --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "completion, expected, value",
    [
        ("The total is 1,234,567.", 1234567, 1.0),
        ("x = -3.5", "-3.5", 1.0),
        ("about 2.5e3 units", 2500, 1.0),
        ("tiny: 1E-3", 0.001, 1.0),
        ("half is .5", 0.5, 1.0),
        # the last number: 12 then 18
        ("12 apples and 6 pears make 18", 18, 1.0),
        ("12 apples and 6 pears make 18", 12, 0.0),
        # a minus glued to a number after a word is a dash: 3-5 ends in 5, not -5
        ("pages 3-5", 5, 1.0),
        # commas between single digits are a list, not thousands
        ("1,2,3", 3, 1.0),
        # a comma before four digits is not a thousands comma: 1 and 2345, never 1234
        ("1,2345", 2345, 1.0),
        ("1,2345", 1234, 0.0),
        # digits after a second decimal point continue no number: 1.2.3 is 1.2, never 3
        ("1.2.3", 1.2, 1.0),
        ("1.2.3", 3, 0.0),
        # \boxed wins over the last number
        ("first 7, then \\boxed{12} and 99 more", 12, 1.0),
        ("\\boxed{ -1,000 }", "-1,000", 1.0),
        # a \boxed that is not one number scores 0, even where a number follows
        ("\\boxed{x+1} so 5", 5, 0.0),
        # ... an equation too: the boxed content is the number alone (docs/grpo-rewards.md)
        ("\\boxed{x = 5}", 5, 0.0),
        ("\\boxed{ 5 }", 5, 1.0),
        ("no idea", 3, 0.0),
        ("", 0, 0.0),
        # 0.1 + 0.2 is not 0.3 in binary, within the default tolerance 1e-6 it is
        ("0.3", 0.1 + 0.2, 1.0),
        ("1.000002", 1, 0.0),
    ],
)
def test_numeric(completion, expected, value):
    assert _score({"kind": "numeric", "column": "n"}, [completion], [expected]) == [value]


def test_numeric_tolerance_is_inclusive():
    reward = {"kind": "numeric", "column": "n", "tolerance": 0.5}
    completions = ["1.5", "0.5", "1.75", "0.25"]
    assert _score(reward, completions, [1, 1, 1, 1]) == [1.0, 1.0, 0.0, 0.0]


def test_numeric_refuses_an_expected_value_that_is_not_a_number():
    with pytest.raises(RewardError, match=r"reward numeric at update 3, column n: .*'many'"):
        _score({"kind": "numeric", "column": "n"}, ["1", "2"], [1, "many"], update=3)


# -- regex and format -----------------------------------------------------------------------------


def test_regex_matches_the_whole_completion_and_format_the_stripped_one():
    completions = ["42", " 42 ", "42\n", "x42", "4\n2"]
    assert _score({"kind": "regex", "pattern": r"\d+"}, completions) == [1, 0, 0, 0, 0]
    assert _score({"kind": "format", "pattern": r"\d+"}, completions) == [1, 1, 1, 0, 0]
    # '.' matches a newline
    assert _score({"kind": "regex", "pattern": r"4.2"}, completions) == [0, 0, 0, 0, 1]


def test_format_think_then_answer():
    pattern = r"<think>.*?</think>\s*<answer>.*?</answer>"
    completions = [
        "<think>hmm\nso 4</think>\n<answer>4</answer>\n",
        "\n<think>x</think><answer></answer>",
        "<think>hmm</think> 4",
        "<answer>4</answer><think>x</think>",
        "<think>x</think><answer>4</answer> trailing",
    ]
    assert _score({"kind": "format", "pattern": pattern}, completions) == [1, 1, 0, 0, 0]


# -- length ---------------------------------------------------------------------------------------


def test_length_penalises_only_past_the_target():
    values = _score({"kind": "length", "target": 4}, ["a"] * 5, lengths=[0, 3, 4, 5, 12])
    assert values == [0.0, 0.0, 0.0, -0.25, -2.0]


# -- weights and the total ------------------------------------------------------------------------


def test_score_in_list_order_and_the_weighted_total():
    entries = [
        {"kind": "exact_match", "column": "answer", "weight": 2},
        {"kind": "length", "target": 2, "weight": 0.5},
        {"kind": "regex", "pattern": r".*sorry.*", "weight": -1, "name": "apology"},
    ]
    assert rewards.normalize(entries, []) == []
    values = rewards.score(
        entries,
        prompts=["q1", "q1", "q2"],
        completions=["<answer>7</answer>", "sorry, 7", "<answer>8</answer>"],
        completion_ids=[[1, 2], [1, 2, 3, 4], [1, 2, 3]],
        columns={"answer": ["7", "7", "9"], "level": [1, 1, 2]},
        update=0,
        files={},
    )
    assert list(values) == ["exact_match", "length", "apology"]
    # "sorry, 7" has no answer tag and no \boxed: its final answer is the whole text
    assert values["exact_match"].tolist() == [1.0, 0.0, 0.0]
    assert values["length"].tolist() == [0.0, -1.0, -0.5]
    assert values["apology"].tolist() == [0.0, 1.0, 0.0]
    # 2·1 + 0.5·0 - 1·0, 2·0 + 0.5·(-1) - 1·1, 2·0 + 0.5·(-0.5) - 1·0
    summed = rewards.total(entries, values)
    assert summed.dtype == np.float64 and summed.tolist() == [2.0, -1.5, -0.25]


def test_total_refuses_a_sum_that_is_not_finite():
    entries = [{"name": "a", "weight": 1.0}, {"name": "b", "weight": 10.0}]  # all total reads
    values = {"a": np.array([1.0, 1e308]), "b": np.array([0.0, 1e308])}
    with pytest.raises(RewardError, match="not finite for completion 1"):
        rewards.total(entries, values)


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_total_refuses_an_infinite_or_nan_value(bad):
    """Either infinity (a python reward may return −inf as a "never") and NaN."""
    entries = [{"name": "a", "weight": 1.0}, {"name": "b", "weight": 0.5}]
    values = {"a": np.array([1.0, 0.0, 2.0]), "b": np.array([0.0, 0.0, bad])}
    with pytest.raises(RewardError, match="not finite for completion 2"):
        rewards.total(entries, values)
    # the overflow of a sum of finite values, to −inf
    with pytest.raises(RewardError, match="not finite for completion 0"):
        rewards.total(entries, {"a": np.array([-1e308]), "b": np.array([-1.8e308])})


# -- normalize ------------------------------------------------------------------------------------


def test_names_are_filled_per_kind_in_list_order():
    entries = [
        {"kind": "exact_match", "column": "a"},
        {"kind": "exact_match", "column": "b"},
        {"kind": "regex", "pattern": "x", "name": "strict"},
        {"kind": "regex", "pattern": "y"},
        {"kind": "exact_match", "column": "c"},
    ]
    assert rewards.normalize(entries, []) == []
    names = [entry["name"] for entry in entries]
    assert names == ["exact_match", "exact_match_2", "strict", "regex", "exact_match_3"]
    again = copy.deepcopy(entries)
    assert rewards.normalize(again, []) == [] and again == entries  # a second pass changes nothing


def test_duplicate_names_are_refused():
    entries = [
        {"kind": "regex", "pattern": "a"},
        {"kind": "format", "pattern": "b", "name": "regex"},
        {"kind": "length", "target": 3, "name": "short"},
        {"kind": "length", "target": 9, "name": "short"},
    ]
    errors = rewards.normalize(entries, [])
    assert [e["path"] for e in errors] == ["/rl/rewards/1/name", "/rl/rewards/3/name"]
    assert "/rl/rewards/0" in errors[0]["message"] and "unique" in errors[0]["message"]
    assert "/rl/rewards/2" in errors[1]["message"]


@pytest.mark.parametrize("kind", ["regex", "format"])
def test_a_pattern_that_does_not_compile_is_refused(kind):
    entries = [{"kind": "length", "target": 3}, {"kind": kind, "pattern": "(unclosed"}]
    [error] = rewards.normalize(entries, [])
    assert error["path"] == "/rl/rewards/1/pattern"
    assert "missing )" in error["message"]


def test_a_python_file_that_is_not_a_pinned_input_is_refused():
    entries = [{"kind": "python", "file": "reward.py", "function": "score"}]
    [error] = rewards.normalize(entries, ["train", "helpers.py"])
    assert error["path"] == "/rl/rewards/0/file"
    assert "'reward.py'" in error["message"] and "helpers.py, train" in error["message"]
    assert rewards.normalize([dict(entries[0])], ["train", "reward.py"]) == []


def test_an_empty_list_is_refused():
    assert rewards.normalize([], []) == [
        {"path": "/rl/rewards", "message": "needs at least one reward"}
    ]


def test_absent_values_are_filled_in_one_spelling():
    entries = [
        {"kind": "exact_match", "column": "a"},
        {"kind": "numeric", "column": "b", "weight": 2, "tolerance": 0},
        {"kind": "numeric", "column": "b", "name": "near"},
        {"kind": "python", "file": "r.py", "function": "f", "timeout_seconds": 5},
        {"kind": "regex", "pattern": "x"},
        {"kind": "length", "target": 8},
    ]
    assert rewards.normalize(entries, ["r.py"]) == []
    assert entries == [
        {
            "kind": "exact_match",
            "column": "a",
            "name": "exact_match",
            "weight": 1.0,
            "ignore_case": False,
        },
        {"kind": "numeric", "column": "b", "name": "numeric", "weight": 2.0, "tolerance": 0.0},
        {"kind": "numeric", "column": "b", "name": "near", "weight": 1.0, "tolerance": 1e-6},
        {
            "kind": "python",
            "file": "r.py",
            "function": "f",
            "name": "python",
            "weight": 1.0,
            "timeout_seconds": 5.0,
            "memory_mb": 2048,
        },
        {"kind": "regex", "pattern": "x", "name": "regex", "weight": 1.0},
        {"kind": "length", "target": 8, "name": "length", "weight": 1.0},
    ]
    # floats as floats: 2 and 2.0, 0 and 0.0, 5 and 5.0 are one computation
    assert type(entries[1]["weight"]) is float and type(entries[1]["tolerance"]) is float
    assert type(entries[3]["timeout_seconds"]) is float
    assert type(entries[3]["memory_mb"]) is int


def test_columns_read():
    entries = [
        {"kind": "exact_match", "column": "a"},
        {"kind": "regex", "pattern": "x"},
        {"kind": "numeric", "column": "b"},
        {"kind": "exact_match", "column": "a", "ignore_case": True},
        {"kind": "length", "target": 3},
    ]
    assert rewards.columns_read(entries) == ["a", "b"]


# -- the schema -----------------------------------------------------------------------------------


def _validator(schema=None):
    schema = schema or schemas.load(rewards.SCHEMA_FILE)
    return jsonschema.Draft202012Validator(schema, registry=schemas.registry())


GOOD = [
    {"kind": "exact_match", "column": "answer"},
    {"kind": "exact_match", "column": "answer", "ignore_case": True, "weight": 2, "name": "em"},
    {"kind": "regex", "pattern": "\\d+", "weight": -0.5},
    {"kind": "numeric", "column": "n", "tolerance": 0.01},
    {"kind": "format", "pattern": "<think>.*?</think>"},
    {"kind": "length", "target": 512, "weight": 0.1},
    {"kind": "python", "file": "reward.py", "function": "score"},
    {
        "kind": "python",
        "file": "reward.py",
        "function": "_score2",
        "timeout_seconds": 0.5,
        "memory_mb": 64,
        "name": "judge_2",
    },
]

BAD = [
    ({"kind": "exact_match", "column": "a", "pattern": "x"}, "'pattern' was unexpected"),
    ({"kind": "regex", "pattern": "x", "tolerance": 0.1}, "'tolerance' was unexpected"),
    ({"kind": "length", "target": 4, "column": "a"}, "'column' was unexpected"),
    ({"kind": "python", "file": "r.py", "function": "f", "ignore_case": True}, "unexpected"),
    ({"kind": "bleu", "column": "a"}, "is not one of"),
    ({"column": "a"}, "'kind' is a required property"),
    ({"kind": "numeric"}, "'column' is a required property"),
    ({"kind": "python", "file": "r.py"}, "'function' is a required property"),
    ({"kind": "regex", "pattern": "x", "name": "Upper"}, "does not match"),
    ({"kind": "length", "target": 0}, "less than the minimum"),
    ({"kind": "numeric", "column": "n", "tolerance": -1}, "less than the minimum"),
    ({"kind": "python", "file": "r.py", "function": "f", "memory_mb": 32}, "less than"),
    ({"kind": "python", "file": "r.py", "function": "f", "timeout_seconds": 0}, "less than"),
    ({"kind": "python", "file": "r.py", "function": "a-b"}, "does not match"),
    ({"kind": "regex", "pattern": "x", "weight": float("inf")}, "greater than the maximum"),
]


@pytest.mark.parametrize("entry", GOOD)
def test_good_entries_pass_the_schema(entry):
    assert list(_validator().iter_errors(entry)) == []


@pytest.mark.parametrize("entry, message", BAD)
def test_bad_entries_fail_the_schema(entry, message):
    errors = [error.message for error in _validator().iter_errors(entry)]
    assert errors and any(message in text for text in errors), errors


def test_a_list_of_entries_by_reference_and_the_weight_default():
    """The way the grpo schema refers to an entry: by $id from an array, defaults filled by the
    recipe's validator."""
    schema = {
        "type": "array",
        "items": {"$ref": "https://minifield.dev/schemas/rl-reward.schema.json"},
    }
    document = [{"kind": "regex", "pattern": "x"}, {"kind": "length", "target": 4, "weight": 3}]
    assert recipe.validate_document(document, schema, ("rl", "rewards")) == []
    assert [entry["weight"] for entry in document] == [1.0, 3]
    bad = [{"kind": "length", "target": 4}, {"kind": "regex", "pattern": "x", "column": "a"}]
    [error] = recipe.validate_document(bad, schema, ("rl", "rewards"))
    assert error["path"] == "/rl/rewards/1" and "'column' was unexpected" in error["message"]


def test_every_key_is_described_and_every_kind_has_its_branch():
    schema = schemas.load(rewards.SCHEMA_FILE)
    assert tuple(schema["properties"]["kind"]["enum"]) == rewards.KINDS
    assert all("description" in spec for spec in schema["properties"].values())
    branches = {b["if"]["properties"]["kind"]["const"]: b["then"] for b in schema["allOf"]}
    assert tuple(branches) == rewards.KINDS
    for kind, then in branches.items():
        assert then["additionalProperties"] is False
        for key, spec in then["properties"].items():
            assert "description" in spec or spec == {"$ref": f"#/properties/{key}"}, (kind, key)
