"""A user's reward function, from a pinned input file, run in a process of its own.

The function is called the way TRL calls reward functions::

    fn(prompts=[...], completions=[...], completion_ids=[[...], ...], **columns)

with every other column of the prompt rows as a keyword (a list with one value per
completion) and returns one number per completion. TRL also passes ``trainer_state``; this
does not (a reward here is a function of the rollout alone, so an update's rewards can be
recomputed from its recorded rollouts). None is not a reward: every completion must be scored.

The process (:mod:`.reward_runner`, run by path) is bounded: a wall-clock limit (the whole
process group is killed past it), an address-space limit (``RLIMIT_AS``, set by the runner
itself before it reads anything: a ``preexec_fn`` is unsafe in a process with threads, as a
JAX process is), an empty temporary working directory, and the result written
to a file, so the function's prints (sent to this process's stderr) cannot break it. Every
failure raises :class:`RewardError` naming the reward, the function, the file and the update;
nothing fails into a silent 0. Importing this module does not import JAX.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

RUNNER = Path(__file__).with_name("reward_runner.py")
#: the keywords every call has; a prompt-row column may not take one of these names
FIXED_KEYWORDS = ("prompts", "completions", "completion_ids")


class RewardError(Exception):
    """A reward could not score an update's completions; the message is for the user."""


def _environment() -> dict:
    # what -I (isolated mode) would give, except the hash seed: -I ignores PYTHONHASHSEED, and a
    # function that iterates over a set of strings would then score differently on every run
    environment = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    environment["PYTHONHASHSEED"] = "0"
    # RLIMIT_AS counts reserved address space, and each BLAS thread reserves buffers of its
    # own: without this the memory a function needs would grow with the machine's core count
    for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        environment[name] = "1"
    return environment


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:  # the group is already gone
        pass


def _run_runner(directory: str, timeout: float, memory_mb: int) -> tuple[bool, int]:
    """(timed out, return code) of the runner on ``directory``; nothing of it outlives this."""
    process = subprocess.Popen(
        # -s -P and the environment below: isolated mode (-I) but for the hash seed; -B: the
        # file's bytecode is not written beside it (a published export's directory holds it,
        # and the store's gate finds any file the manifest does not list)
        [sys.executable, "-s", "-P", "-B", str(RUNNER), directory, str(memory_mb << 20)],
        cwd=directory,
        env=_environment(),
        stdin=subprocess.DEVNULL,
        stdout=2,  # the function's prints go to the log, never to this process's stdout
        start_new_session=True,  # its own process group, killed whole
    )
    timed_out = False
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        # also on a normal end: a process the function started must not outlive the call
        _kill_group(process.pid)
        process.wait()
    return timed_out, process.returncode


def _call_text(where: str, call: dict) -> str:
    """``call`` as JSON, numpy values as lists; a value JSON cannot hold is named."""

    def plain(value):
        if hasattr(value, "tolist"):  # numpy arrays and scalars
            return value.tolist()
        raise TypeError(f"a {type(value).__name__} is not JSON")

    try:
        return json.dumps(call, default=plain)
    except (TypeError, ValueError) as error:
        for key, value in call["kwargs"].items():
            try:
                json.dumps(value, default=plain)
            except (TypeError, ValueError):
                raise RewardError(
                    f"{where}: its argument {key} cannot be passed to the reward process ({error})"
                ) from None
        raise


def _failure(where: str, error: dict, reward: dict, path: Path) -> RewardError:
    stage, kind, message = error["stage"], error["type"], error["message"]
    at = f" ({path.name}, {error['at']})" if error.get("at") else ""
    if kind == "MemoryError":
        return RewardError(
            f"{where}: ran out of memory (MemoryError) under its limit of "
            f"{reward['memory_mb']} MiB (the recipe key memory_mb){at}"
        )
    if stage == "import":
        return RewardError(f"{where}: importing {path} failed: {kind}: {message}{at}")
    if stage == "function":
        if kind == "missing":
            defined = f" (it defines: {message})" if message else ""
            return RewardError(f"{where}: {path} has no function {reward['function']}{defined}")
        return RewardError(f"{where}: {reward['function']} in {path} is a {kind}, not a function")
    if stage == "call":
        return RewardError(f"{where}: the function raised {kind}: {message}{at}")
    return RewardError(f"{where}: the function returned a {kind}, not a list of numbers")


def _ended(where: str, code: int, reward: dict) -> RewardError:
    """The runner ended without writing its result."""
    if code < 0:
        name = signal.Signals(-code).name
        hint = (
            " (most likely over its memory limit: the recipe key memory_mb)"
            if -code in (signal.SIGKILL, signal.SIGSEGV, signal.SIGABRT)
            else ""
        )
        return RewardError(
            f"{where}: the reward process was killed by {name} with no result; its limit is "
            f"{reward['memory_mb']} MiB{hint}; its output is in the log"
        )
    return RewardError(
        f"{where}: the reward process ended with exit status {code} and no result (the "
        "function or its file ended the process: see its output in the log)"
    )


def _not_a_number(value) -> str | None:
    """Why ``value`` (as the runner sent it) is not a reward, or None if it is one (a bool is
    one: True is 1.0, as Python's arithmetic has it)."""
    if value is None:
        return "is None (every completion needs a number)"
    if isinstance(value, str):
        return f"is a str ({value[:60]!r}), not a number"
    if isinstance(value, dict):  # the runner's description of any other object
        return f"is a {value['type']} ({value['repr']}), not a number"
    if not math.isfinite(value):
        return f"is {value}, not a finite number"
    return None


def _values(where: str, values: list, expected: int) -> np.ndarray:
    if len(values) != expected:
        raise RewardError(
            f"{where}: the function returned the wrong number of values: expected {expected} "
            f"(one per completion), got {len(values)}"
        )
    for index, value in enumerate(values):
        problem = _not_a_number(value)
        if problem:
            raise RewardError(f"{where}: value {index} {problem}")
    return np.asarray(values, dtype=np.float64)


def run(
    reward: dict,
    path: Path,
    *,
    prompts: list,
    completions: list[str],
    completion_ids: list[list[int]],
    columns: dict[str, list],
    update: int,
) -> np.ndarray:
    """The normalised python reward ``reward`` (its ``function``, ``timeout_seconds``,
    ``memory_mb``) of the file ``path`` on the completions: float64 [N]; raises
    :class:`RewardError`."""
    where = (
        f"reward {reward['name']} (function {reward['function']} of pinned input "
        f"{reward['file']}) at update {update}"
    )
    clashes = sorted(set(columns) & set(FIXED_KEYWORDS))
    if clashes:
        raise RewardError(
            f"{where}: the prompt rows have a column {clashes[0]}, a name the function's own "
            f"arguments take ({', '.join(FIXED_KEYWORDS)}): rename the column"
        )
    kwargs = {
        "prompts": prompts,
        "completions": completions,
        "completion_ids": completion_ids,
        **columns,
    }
    call = {"file": str(Path(path).resolve()), "function": reward["function"], "kwargs": kwargs}
    text = _call_text(where, call)
    with tempfile.TemporaryDirectory(prefix="minifield-reward-") as directory:
        Path(directory, "call.json").write_text(text, encoding="utf-8")
        timed_out, code = _run_runner(directory, reward["timeout_seconds"], reward["memory_mb"])
        result = Path(directory, "result.json")
        # the runner exits 0 only after its result is whole
        written = code == 0 and not timed_out and result.exists()
        payload = json.loads(result.read_text(encoding="utf-8")) if written else None
    if timed_out:
        raise RewardError(
            f"{where}: did not finish within {reward['timeout_seconds']:g} s (the recipe key "
            "timeout_seconds; the time counts the process's start and the file's import)"
        )
    if payload is None:
        raise _ended(where, code, reward)
    if "error" in payload:
        raise _failure(where, payload["error"], reward, Path(path))
    return _values(where, payload["values"], len(completions))
