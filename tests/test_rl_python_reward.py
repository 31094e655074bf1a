"""The python reward for real: small reward files under tmp_path, each run in its own bounded
process. What the function receives (exactly the keywords TRL passes, less ``trainer_state``),
and every way it can fail, each ending in a RewardError that names the function and the
update."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from minifield.rl import python_reward, rewards
from minifield.rl.rewards import RewardError

# every test starts the reward's process, which the fast tier's guard (tests/conftest.py) allows
# only in the slow tier; each takes well under a second except the timeout's (1 s)
pytestmark = pytest.mark.slow

PROMPTS = ["What is 2+3?", "What is 2+3?", "Name a colour."]
COMPLETIONS = ["<answer>5</answer>", "six", "<answer>red</answer>"]
IDS = [[11, 12, 13], [14], [15, 16]]
COLUMNS = {"answer": ["5", "5", "red"], "level": [1, 1, 2]}


def _reward(tmp_path: Path, source: str, **settings) -> tuple[dict, Path]:
    """A normalised python reward of function ``score`` in a file holding ``source``."""
    path = tmp_path / "reward.py"
    path.write_text(textwrap.dedent(source), encoding="utf-8")
    entry = {"kind": "python", "file": "reward.py", "function": "score", **settings}
    assert rewards.normalize([entry], ["reward.py"]) == []
    return entry, path


def _run(tmp_path: Path, source: str, update: int = 7, **settings):
    entry, path = _reward(tmp_path, source, **settings)
    return python_reward.run(
        entry,
        path,
        prompts=PROMPTS,
        completions=COMPLETIONS,
        completion_ids=IDS,
        columns=COLUMNS,
        update=update,
    )


def _failure(tmp_path: Path, source: str, update: int = 7, **settings) -> str:
    """The message of the RewardError the call ends in; it names the function and the update."""
    with pytest.raises(RewardError) as caught:
        _run(tmp_path, source, update=update, **settings)
    message = str(caught.value)
    assert "function score" in message and f"update {update}" in message, message
    assert "pinned input reward.py" in message, message
    return message


def test_nothing_is_written_beside_the_file(tmp_path):
    # the file may be a published export's copy, which the store's gate checks file by file
    # (its manifest lists every one): importing it must not leave its bytecode there
    values = _run(
        tmp_path, "def score(completions, **kwargs):\n    return [1.0] * len(completions)\n"
    )
    assert values.tolist() == [1.0, 1.0, 1.0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["reward.py"]


def test_the_function_receives_what_trl_passes_and_its_values_come_back(tmp_path):
    received = tmp_path / "received.json"
    values = _run(
        tmp_path,
        f"""
        import json
        import sys

        def score(**kwargs):
            loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("minifield", "jax"))
            with open({str(received)!r}, "w") as file:
                json.dump({{"kwargs": kwargs, "loaded": loaded}}, file)
            return [float(len(c)) for c in kwargs["completions"]]
        """,
    )
    seen = json.loads(received.read_text())
    assert seen["kwargs"] == {
        "prompts": ["What is 2+3?", "What is 2+3?", "Name a colour."],
        "completions": ["<answer>5</answer>", "six", "<answer>red</answer>"],
        "completion_ids": [[11, 12, 13], [14], [15, 16]],
        "answer": ["5", "5", "red"],
        "level": [1, 1, 2],
    }
    assert seen["loaded"] == []  # the process holds neither minifield nor JAX
    assert values.dtype.name == "float64" and values.tolist() == [18.0, 3.0, 20.0]


def test_named_arguments_and_ints_bools_and_numpy_arrays_as_numbers(tmp_path):
    values = _run(
        tmp_path,
        """
        import numpy as np

        def score(prompts, completions, answer, **kwargs):
            return np.array([c == f"<answer>{a}</answer>" for c, a in zip(completions, answer)])
        """,
    )
    assert values.tolist() == [1.0, 0.0, 1.0]  # numpy bools
    assert _run(tmp_path, "def score(**kw):\n    return (1, -2, 3)\n").tolist() == [1.0, -2.0, 3.0]
    source = (
        "import numpy as np\n\ndef score(**kw):\n    return [np.float32(0.5), True, np.int64(4)]\n"
    )
    assert _run(tmp_path, source).tolist() == [0.5, 1.0, 4.0]


def test_prints_on_stdout_do_not_break_the_result(tmp_path, capfd):
    values = _run(
        tmp_path,
        """
        import sys
        print('{"values": [9, 9, 9]}')

        def score(completions, **kwargs):
            print("scoring", len(completions))
            sys.stdout.write('{"error": "not really"}\\n')
            return [0.25, 0.5, 0.75]
        """,
    )
    assert values.tolist() == [0.25, 0.5, 0.75]
    out, err = capfd.readouterr()
    assert "scoring 3" in err and "scoring" not in out  # on stderr: this process's stdout is kept


def test_the_hash_seed_is_fixed(tmp_path):
    source = "def score(completions, **kw):\n    return [hash(c) % 1000003 for c in completions]\n"
    first = _run(tmp_path, source).tolist()
    assert _run(tmp_path, source).tolist() == first


def test_through_score_beside_a_built_in(tmp_path):
    entry, path = _reward(tmp_path, "def score(completions, **kw):\n    return [0.5] * 3\n")
    entries = [{"kind": "exact_match", "column": "answer"}, entry]
    assert rewards.normalize(entries, ["reward.py"]) == []
    values = rewards.score(
        entries,
        prompts=PROMPTS,
        completions=COMPLETIONS,
        completion_ids=IDS,
        columns=COLUMNS,
        update=3,
        files={"reward.py": path},
    )
    assert list(values) == ["exact_match", "python"]
    assert values["python"].tolist() == [0.5, 0.5, 0.5]
    assert rewards.total(entries, values).tolist() == [1.5, 0.5, 1.5]


def test_it_raises(tmp_path):
    message = _failure(
        tmp_path,
        """
        def score(**kwargs):
            x = 1
            raise ValueError("no answer column here")
        """,
    )
    assert "raised ValueError: no answer column here" in message
    assert "reward.py, line 4, in score" in message


def test_it_times_out(tmp_path):
    started = time.monotonic()
    message = _failure(
        tmp_path,
        """
        import time

        def score(**kwargs):
            time.sleep(30)
        """,
        timeout_seconds=1,
    )
    assert time.monotonic() - started < 10
    assert "within 1 s" in message and "timeout_seconds" in message


def test_a_timeout_kills_what_the_function_started(tmp_path):
    pid_file = tmp_path / "pid"
    _failure(
        tmp_path,
        f"""
        import subprocess
        import time

        def score(**kwargs):
            child = subprocess.Popen(["sleep", "30"])
            with open({str(pid_file)!r}, "w") as file:
                file.write(str(child.pid))
            time.sleep(30)
        """,
        timeout_seconds=1,
    )
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            break
        if state in ("Z", "X"):  # killed, waiting for its new parent to reap it
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the function's child {pid} survived the timeout")


def test_it_runs_out_of_memory(tmp_path):
    message = _failure(
        tmp_path,
        """
        def score(**kwargs):
            kept = []
            for _ in range(64):
                kept.append(bytearray(64 << 20))  # 4 GiB in all, far past the limit
            return [0.0] * 3
        """,
        memory_mb=128,
    )
    assert "MemoryError" in message and "128 MiB" in message and "memory_mb" in message


def test_killed_without_a_result(tmp_path):
    source = "import os, signal\n\ndef score(**kw):\n    os.kill(os.getpid(), signal.SIGKILL)\n"
    message = _failure(tmp_path, source)
    assert "killed by SIGKILL" in message and "memory_mb" in message


def test_it_ends_the_process(tmp_path):
    message = _failure(tmp_path, "import os\n\ndef score(**kw):\n    os._exit(3)\n")
    assert "exit status 3" in message


def test_a_wrong_count(tmp_path):
    message = _failure(tmp_path, "def score(**kwargs):\n    return [1.0]\n")
    assert "expected 3" in message and "got 1" in message


@pytest.mark.parametrize(
    "values, words",
    [
        ("[0.5, float('nan'), 1.0]", "value 1 is nan, not a finite number"),
        ("[0.5, 1.0, -float('inf')]", "value 2 is -inf, not a finite number"),
        ("[0.5, 1.0, 10 ** 400]", "value 2 is a int (an integer of 1329 bits), not a number"),
        ("[1.0, 'high', 0.0]", "value 1 is a str ('high'), not a number"),
        ("[None, 1.0, 0.0]", "value 0 is None (every completion needs a number)"),
        ("[1.0, [2.0], 0.0]", "value 1 is a list ([2.0]), not a number"),
        ("[object(), 1.0, 0.0]", "value 0 is a object (<object object at"),
    ],
)
def test_a_value_that_is_not_a_finite_number(tmp_path, values, words):
    message = _failure(tmp_path, f"def score(**kwargs):\n    return {values}\n")
    assert words in message, message


def test_it_returns_no_list(tmp_path):
    message = _failure(tmp_path, "def score(**kwargs):\n    return 3.0\n")
    assert "returned a float, not a list of numbers" in message


def test_the_file_fails_to_import(tmp_path):
    message = _failure(tmp_path, "import not_a_module_xyz\n\ndef score(**kw):\n    return []\n")
    assert "importing" in message and "ModuleNotFoundError" in message
    assert "not_a_module_xyz" in message and "reward.py, line 1" in message


def test_the_file_does_not_parse(tmp_path):
    message = _failure(tmp_path, "def helper():\n    return 1\n\ndef score(:\n    pass\n")
    assert "SyntaxError" in message and "line 4" in message


def test_the_function_is_missing(tmp_path):
    message = _failure(tmp_path, "def scores(**kw):\n    return []\n\nlimit = 3\n")
    assert "has no function score (it defines: scores)" in message


def test_the_name_is_not_a_function(tmp_path):
    message = _failure(tmp_path, "score = 3\n")
    assert "score in" in message and "is a int, not a function" in message


def test_a_column_named_like_an_argument_is_refused(tmp_path):
    entry, path = _reward(tmp_path, "def score(**kw):\n    return [0.0]\n")
    with pytest.raises(RewardError, match=r"function score .* update 2: .*column completions"):
        python_reward.run(
            entry,
            path,
            prompts=["p"],
            completions=["c"],
            completion_ids=[[1]],
            columns={"completions": ["x"]},
            update=2,
        )


def test_the_reward_modules_do_not_import_jax():
    probe = "import sys, minifield.rl.rewards; print('jax' in sys.modules)"
    shown = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    )
    assert shown.stdout.strip() == "False"
