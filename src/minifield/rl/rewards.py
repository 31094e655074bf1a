"""The rewards of ``rl.rewards``: one spelling per computation, the built-in rules, the scores of
an update's completions and their weighted sum.

A reward entry is checked by ``rl-reward.schema.json``; :func:`normalize` then fills what the
schema cannot (the names, the value an absent key means) and refuses what it cannot express (a
pattern that does not compile, a file that is not a pinned input, two rewards of one name).
:func:`score` computes every reward of the list on an update's completions; kind ``python``
runs in a process of its own (:mod:`.python_reward`). Importing this module does not import
JAX. See docs/grpo-rewards.md.
"""

from __future__ import annotations

import functools
import math
import re
from pathlib import Path

import numpy as np

from .. import schemas
from . import python_reward
from .python_reward import RewardError

KINDS = ("exact_match", "regex", "numeric", "format", "length", "python")
SCHEMA_FILE = "rl-reward.schema.json"
#: the kinds that read a column of the prompt rows (their ``column`` key)
WITH_COLUMN = ("exact_match", "numeric")
#: a number in text: an optional minus not glued to a word (``3-5`` is 3 and 5), digits with
#: optional thousands commas (``1,234``), an optional fraction and an optional exponent; not
#: inside a word or right after a decimal point (``x2``; ``1.2.3`` is 1.2, its ``.3`` no number)
NUMBER = re.compile(
    r"(?<![\w.])-?(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)(?:[eE][-+]?\d+)?"
)
_BOXED = "\\boxed{"
_SPACES = re.compile(r"\s+")


@functools.cache
def _kind_properties() -> dict[str, dict]:
    """``{kind: {key: property schema}}`` from each kind's ``then`` in the schema."""
    return {
        branch["if"]["properties"]["kind"]["const"]: branch["then"]["properties"]
        for branch in schemas.load(SCHEMA_FILE)["allOf"]
    }


def _default_weight() -> float:
    return schemas.load(SCHEMA_FILE)["properties"]["weight"]["default"]


def normalize(rewards: list[dict], input_names: list[str]) -> list[dict]:
    """Fill names and absent values in place (one spelling per computation: floats as floats,
    the ``x-absent`` value of every key the kind reads); returns errors ``[{path, message}]``.
    ``rewards`` has passed the schema; ``input_names`` are the recipe's pinned inputs."""
    if not rewards:
        return [{"path": "/rl/rewards", "message": "needs at least one reward"}]
    errors = []
    unnamed = dict.fromkeys(KINDS, 0)
    for index, reward in enumerate(rewards):
        path = f"/rl/rewards/{index}"
        kind = reward["kind"]
        if kind not in KINDS:
            errors.append({"path": f"{path}/kind", "message": f"must be one of {', '.join(KINDS)}"})
            continue
        if "name" not in reward:
            unnamed[kind] += 1
            reward["name"] = kind if unnamed[kind] == 1 else f"{kind}_{unnamed[kind]}"
        reward["weight"] = float(reward.get("weight", _default_weight()))
        if not math.isfinite(reward["weight"]):
            errors.append({"path": f"{path}/weight", "message": "must be a finite number"})
        for key, spec in _kind_properties()[kind].items():
            if "x-absent" in spec:
                reward.setdefault(key, spec["x-absent"])
                if spec.get("type") == "number":
                    reward[key] = float(reward[key])
        errors += _kind_errors(path, reward, input_names)
    return errors + _duplicate_names(rewards)


def _kind_errors(path: str, reward: dict, input_names: list[str]) -> list[dict]:
    kind = reward["kind"]
    if kind in ("regex", "format"):
        try:
            re.compile(reward["pattern"], re.DOTALL)
        except re.error as error:
            return [
                {
                    "path": f"{path}/pattern",
                    "message": f"is not a Python regular expression: {error}",
                }
            ]
    if kind == "python" and reward["file"] not in input_names:
        pinned = ", ".join(sorted(input_names)) or "none"
        return [
            {
                "path": f"{path}/file",
                "message": f"{reward['file']!r} is not a pinned input of the recipe (its "
                f"inputs: {pinned}); pin the reward's Python file under inputs and name it here",
            }
        ]
    return []


def _duplicate_names(rewards: list[dict]) -> list[dict]:
    first: dict[str, int] = {}
    errors = []
    for index, reward in enumerate(rewards):
        name = reward.get("name")
        if name is None:  # an unknown kind, already reported
            continue
        if name in first:
            errors.append(
                {
                    "path": f"/rl/rewards/{index}/name",
                    "message": f"{name!r} is also the name of /rl/rewards/{first[name]} "
                    "(names are the metric names and must be unique; a reward without a name "
                    "is named after its kind)",
                }
            )
        first.setdefault(name, index)
    return errors


def columns_read(rewards: list[dict]) -> list[str]:
    """The prompt-row columns the rewards read, each once, in list order."""
    return list(dict.fromkeys(r["column"] for r in rewards if r["kind"] in WITH_COLUMN))


def _last_boxed(text: str) -> str | None:
    """The content of the last complete ``\\boxed{...}`` (braces balanced; ``\\{`` and ``\\}``
    are literal braces), or None. One nested in another counts as part of the outer one; an
    unclosed one (a completion cut at its token limit) is skipped."""
    found = None
    start = text.find(_BOXED)
    while start >= 0:
        depth, position = 1, start + len(_BOXED)
        while position < len(text) and depth:
            if text.startswith(("\\{", "\\}"), position):
                position += 2
                continue
            depth += {"{": 1, "}": -1}.get(text[position], 0)
            position += 1
        if depth:
            break
        found = text[start + len(_BOXED) : position - 1]
        start = text.find(_BOXED, position)
    return found


def final_answer(text: str) -> str:
    """The completion's final answer: the text inside the last ``<answer>...</answer>``, else
    the content of the last ``\\boxed{...}``, else the whole text (not normalised)."""
    end = text.rfind("</answer>")
    start = text.rfind("<answer>", 0, end) if end >= 0 else -1
    if start >= 0:
        return text[start + len("<answer>") : end]
    boxed = _last_boxed(text)
    return text if boxed is None else boxed


def _normalized(text: str, ignore_case: bool) -> str:
    text = _SPACES.sub(" ", text).strip()
    return text.casefold() if ignore_case else text


def _number_in(text: str) -> float | None:
    """The number a completion gives: the ``\\boxed{}`` content if there is one (which must then
    be one number), else the last number in the text."""
    boxed = _last_boxed(text)
    if boxed is not None:
        match = NUMBER.fullmatch(boxed.strip())
        number = match and match.group()
    else:
        number = ([None, *NUMBER.findall(text)])[-1]
    return None if number is None else float(number.replace(",", ""))


def _expected_number(value, where: str, index: int) -> float:
    if isinstance(value, str):
        match = NUMBER.fullmatch(value.strip())
        if match:
            return float(match.group().replace(",", ""))
    elif isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    raise RewardError(f"{where}: the expected value {value!r} (completion {index}) is not a number")


def _builtin(reward: dict, completions: list[str], lengths: list[int], column, where: str):
    kind = reward["kind"]
    if kind == "exact_match":
        ignore_case = reward["ignore_case"]
        return [
            _normalized(final_answer(text), ignore_case) == _normalized(str(value), ignore_case)
            for text, value in zip(completions, column, strict=True)
        ]
    if kind == "numeric":
        values = []
        for index, (text, value) in enumerate(zip(completions, column, strict=True)):
            expected = _expected_number(value, where, index)
            given = _number_in(text)
            values.append(given is not None and abs(given - expected) <= reward["tolerance"])
        return values
    if kind == "regex":
        pattern = re.compile(reward["pattern"], re.DOTALL)
        return [pattern.fullmatch(text) is not None for text in completions]
    if kind == "format":
        pattern = re.compile(reward["pattern"], re.DOTALL)
        return [pattern.fullmatch(text.strip()) is not None for text in completions]
    target = reward["target"]  # length
    return [0.0 if n <= target else -(n - target) / target for n in lengths]


def score(
    rewards: list[dict],
    *,
    prompts: list,
    completions: list[str],
    completion_ids: list[list[int]],
    columns: dict[str, list],
    update: int,
    files: dict[str, Path],
) -> dict[str, np.ndarray]:
    """Each reward's value per completion, float64 [N], by reward name, in list order; raises
    :class:`RewardError`. ``columns`` holds every other column of the prompt rows, one value
    per completion (already repeated G times); ``files`` maps pinned input names to their
    verified paths (for python rewards)."""
    count = len(completions)
    sizes = {len(prompts), len(completion_ids), *(len(values) for values in columns.values())}
    if sizes != {count}:
        raise ValueError(f"score: {count} completions but lists of lengths {sorted(sizes)}")
    lengths = [len(ids) for ids in completion_ids]
    scores = {}
    for reward in rewards:
        where = f"reward {reward['name']} at update {update}"
        if reward["kind"] == "python":
            scores[reward["name"]] = python_reward.run(
                reward,
                files[reward["file"]],
                prompts=prompts,
                completions=completions,
                completion_ids=completion_ids,
                columns=columns,
                update=update,
            )
            continue
        column = None
        if reward["kind"] in WITH_COLUMN:
            if reward["column"] not in columns:
                raise RewardError(
                    f"{where}: the prompt rows have no column {reward['column']!r} (they have: "
                    f"{', '.join(sorted(columns)) or 'none'})"
                )
            column = columns[reward["column"]]
            where = f"{where}, column {reward['column']}"
        values = _builtin(reward, completions, lengths, column, where)
        scores[reward["name"]] = np.asarray(values, dtype=np.float64)
    return scores


def total(rewards: list[dict], values: dict[str, np.ndarray]) -> np.ndarray:
    """Σ weight · value per completion, float64, summed in list order (one order, one set of
    bits); raises :class:`RewardError` where the sum is not finite."""
    if not rewards:
        raise ValueError("total: no rewards")
    summed = np.zeros(len(values[rewards[0]["name"]]), dtype=np.float64)
    with np.errstate(over="ignore", invalid="ignore"):  # refused below, naming the completion
        for reward in rewards:
            summed = summed + reward["weight"] * np.asarray(values[reward["name"]], np.float64)
    bad = np.flatnonzero(~np.isfinite(summed))
    if bad.size:
        shown = ", ".join(f"{r['name']} {values[r['name']][bad[0]]}" for r in rewards)
        raise RewardError(
            f"the weighted sum of the rewards is not finite for completion {bad[0]} ({shown})"
        )
    return summed
