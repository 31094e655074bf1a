"""Conversations prepared on a pool of forked processes (:mod:`.encode_pool`): the same bytes as
one process, whatever the number of workers (which enters no digest), and a bad row in a later
chunk still refused naming the file and the row, with nothing prepared.

The preparations run in a fresh interpreter (this file run as a script): in the pytest process
an earlier test may have started JAX's backends, and then the pool is not used (a fork there
can deadlock), so an in-process check could pass without a fork. The child counts the
processes it forks.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import REPO  # noqa: E402

from minifield.data import encode_pool  # noqa: E402

DEMO_RECIPE = REPO / "config" / "recipes" / "llama-sft-demo.yaml"
CONVERSATIONS = 300
#: a row the demo's template refuses (it has no system turns), in the pool's second chunk ...
BAD_ROW = 100
#: ... and a later one: the error must name the first in input order, as one process does
LATER_BAD_ROW = 250
#: a blank line after every this many rows (skipped; counted in the ``file:line`` of errors)
BLANK_EVERY = 40


def _conversation(index: int) -> dict:
    word, other = "abcdefgh"[: 3 + index % 5], "xyz"[: 1 + index % 3]
    return {
        "messages": [
            {"role": "user", "content": f"mirror: {word}"},
            {"role": "assistant", "content": word + word[::-1]},
            {"role": "user", "content": f"mirror: {other}"},
            {"role": "assistant", "content": other + other[::-1]},
        ]
    }


def _with_system(row: dict) -> dict:
    return {"messages": [{"role": "system", "content": "be brief"}, *row["messages"]]}


def _line(row: int) -> int:
    """The line of the train file that holds 1-based ``row``: a blank line follows every
    ``BLANK_EVERY`` rows (the reader skips it, error messages count it)."""
    return row + (row - 1) // BLANK_EVERY


def _root(
    tmp_path: Path, bad_rows: tuple[int, ...] = (), empty_rows: tuple[int, ...] = ()
) -> tuple[Path, Path]:
    """An input root holding the Llama demo's base model and DEV/TEST files, and a train file
    of ``CONVERSATIONS`` two-turn conversations (1-based ``bad_rows`` with a system turn, which
    the template refuses; ``empty_rows`` with an empty first answer, which the reader refuses),
    a blank line after every ``BLANK_EVERY`` rows; the demo recipe with that train file pinned,
    written as JSON."""
    import yaml

    root = tmp_path / "root"
    (root / "llama-sft-demo").mkdir(parents=True)
    # copies: inputs are resolved inside the root (a link out of it is refused)
    shutil.copytree(REPO / "data" / "llama-base", root / "llama-base")
    for split in ("dev", "test"):
        name = f"llama-sft-demo/{split}.jsonl"
        shutil.copyfile(REPO / "data" / name, root / name)
    rows = [_conversation(i) for i in range(CONVERSATIONS)]
    for row in bad_rows:
        rows[row - 1] = _with_system(rows[row - 1])
    for row in empty_rows:
        rows[row - 1]["messages"][1]["content"] = " "
    lines = []
    for number, row in enumerate(rows, start=1):
        lines.append(json.dumps(row) + "\n")
        if number % BLANK_EVERY == 0:
            lines.append("\n")
    train = root / "llama-sft-demo" / "train.jsonl"
    train.write_text("".join(lines), encoding="utf-8")
    assert train.read_text().splitlines()[_line(CONVERSATIONS) - 1] == json.dumps(rows[-1])
    recipe = yaml.safe_load(DEMO_RECIPE.read_text())
    for item in recipe["inputs"]:
        if item["name"] == "train":
            item["sha256"] = hashlib.sha256(train.read_bytes()).hexdigest()
    recipe_path = tmp_path / "recipe.json"
    recipe_path.write_text(json.dumps(recipe))
    return root, recipe_path


def _prepare(recipe: Path, root: Path, out: Path, workers: int) -> dict:
    """This file as a script in a fresh interpreter: validate and prepare with ``workers``."""
    env = {**os.environ, encode_pool.WORKERS_ENV: str(workers)}
    proc = subprocess.run(
        [sys.executable, __file__, str(recipe), str(root), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def _file_digests(directory: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.iterdir())
        if p.is_file()
    }


@pytest.mark.slow
def test_one_and_two_workers_prepare_the_same_bytes(tmp_path):
    root, recipe = _root(tmp_path)
    assert len(encode_pool.chunk_bounds(CONVERSATIONS, 2)) > 1  # two workers do share the rows
    one = _prepare(recipe, root, tmp_path / "one", 1)
    two = _prepare(recipe, root, tmp_path / "two", 2)
    assert one == {"error": None, "forks": 0}
    # each split (300, 200 and 200 conversations) on a pool of two: the weights, whose loading
    # starts JAX, load after the conversations are encoded
    assert two == {"error": None, "forks": 3 * 2}
    digests = _file_digests(tmp_path / "one")
    assert digests == _file_digests(tmp_path / "two")
    assert {"manifest.json", "train_tokens.npy", "train_loss_mask.npy"} <= set(digests)
    # the workers are in no digest: the manifests (each with the examples digest) are equal
    manifest = json.loads((tmp_path / "two" / "manifest.json").read_text())
    assert "workers" not in json.dumps(manifest).lower()
    # every conversation's two answers trained, each with its eos: by hand from the rows
    answers = sum(
        len(m["content"]) + 1
        for i in range(CONVERSATIONS)
        for m in _conversation(i)["messages"]
        if m["role"] == "assistant"
    )
    assert manifest["meta"]["splits"]["train"]["loss_tokens"] == answers


@pytest.mark.slow
def test_a_bad_row_in_the_second_chunk_names_the_file_and_row(tmp_path):
    root, recipe = _root(tmp_path, (BAD_ROW, LATER_BAD_ROW))
    first, second = encode_pool.chunk_bounds(CONVERSATIONS, 2)[:2]
    assert first[1] < BAD_ROW <= second[1]  # the row is rendered by the pool's second chunk
    result = _prepare(recipe, root, tmp_path / "examples", 2)
    assert result["forks"] == 2  # the train split's pool, which met the bad row
    train = root / "llama-sft-demo" / "train.jsonl"
    error = result["error"]
    # an InputError: the worker exits 2 on it, the prepare rule fails naming it
    assert error["input_error"]
    assert "\n" not in error["message"]
    assert error["message"].startswith(f"{train}:{_line(BAD_ROW)}: ")
    assert "only user and assistant turns are supported" in error["message"]
    assert not (tmp_path / "examples").exists()


@pytest.mark.slow
def test_a_bad_row_is_named_by_its_line_before_an_earlier_rows_template_error(tmp_path):
    """The workers read the rows too, and the answer is still one process's: that process
    reads the whole file before it renders, so a row the reader refuses (in the pool's third
    chunk) is the error, not the earlier row the template refuses (second chunk)."""
    root, recipe = _root(tmp_path, (BAD_ROW,), (LATER_BAD_ROW,))
    chunks = encode_pool.chunk_bounds(CONVERSATIONS, 2)
    assert chunks[1][0] < BAD_ROW <= chunks[1][1] < LATER_BAD_ROW
    train = root / "llama-sft-demo" / "train.jsonl"
    # by hand: the row's line (blank lines counted), its first answer (messages[1])
    expected = (
        f"{train}:{_line(LATER_BAD_ROW)}: messages[1].content is empty: an assistant turn "
        "must say something to train"
    )
    for workers in (2, 1):
        result = _prepare(recipe, root, tmp_path / f"examples-{workers}", workers)
        assert result["error"] == {"message": expected, "input_error": True}
        assert result["forks"] == (2 if workers == 2 else 0)
        assert not (tmp_path / f"examples-{workers}").exists()


def test_chunks_cover_every_conversation_in_order():
    for count in (0, 1, 63, 64, 65, 300, 10_000):
        for processes in (1, 2, 3, 16):
            bounds = encode_pool.chunk_bounds(count, processes)
            covered = [i for start, end in bounds for i in range(start, end)]
            assert covered == list(range(count))
            assert all(
                encode_pool.MIN_CHUNK <= end - start <= encode_pool.MAX_CHUNK
                for start, end in bounds[:-1]
            )


def test_the_workers_setting_is_checked(monkeypatch):
    monkeypatch.setenv(encode_pool.WORKERS_ENV, "3")
    assert encode_pool.workers() == 3
    for bad in ("0", "-1", "two", ""):
        monkeypatch.setenv(encode_pool.WORKERS_ENV, bad)
        with pytest.raises(encode_pool.WorkersError, match=rf"{encode_pool.WORKERS_ENV}="):
            encode_pool.workers()
    monkeypatch.delenv(encode_pool.WORKERS_ENV)
    assert encode_pool.workers() == len(os.sched_getaffinity(0))


def _child(recipe: Path, root: Path, out: Path) -> None:
    """Validate and prepare ``recipe`` (the pipeline's two stages); print the error, if any."""
    from minifield.inputs.pinned import InputError
    from minifield.pipeline import preparation

    forks = []  # the processes this one forks (the pool's; a subprocess is not a fork here)
    os.register_at_fork(after_in_parent=lambda: forks.append(1))
    validated = out.parent / f"{out.name}.recipe.json"
    preparation.validate(recipe, validated, out.parent / f"{out.name}.validation.json")
    try:
        preparation.prepare(validated, root, out)
        error = None
    except Exception as exc:  # noqa: BLE001 - reported to the test, which checks its kind
        error = {"message": str(exc), "input_error": isinstance(exc, InputError)}
    print(json.dumps({"error": error, "forks": len(forks)}))


if __name__ == "__main__":
    _child(*map(Path, sys.argv[1:4]))
