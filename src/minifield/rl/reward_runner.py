"""The process a python reward runs in: ``python reward_runner.py DIRECTORY MEMORY_BYTES``.

Started by :mod:`minifield.rl.python_reward`, which reads what this writes. It is run by path,
not imported: it imports nothing from minifield (nor JAX), so the process holds only the
interpreter, the user's file and what that file imports. It limits its own address space
before reading anything, loads the file, calls the function with the keywords of
``DIRECTORY/call.json`` and writes ``DIRECTORY/result.json``: ``{"values": [...]}`` or
``{"error": {"stage", "type", "message", "at"}}``. The result goes to a file, never to stdout,
so the function's prints cannot break it.
"""

import importlib.machinery
import importlib.util
import json
import os
import resource
import sys
import traceback

#: how much of a value that is not a number the parent is shown
_SHOWN = 60


def _limit_memory(limit: int) -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def _load(path: str):
    # a loader by hand: the pinned input's file name need not end in .py
    loader = importlib.machinery.SourceFileLoader("reward_module", path)
    spec = importlib.util.spec_from_loader("reward_module", loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules["reward_module"] = module  # dataclasses and pickling look their module up
    loader.exec_module(module)
    return module


def _where(error: BaseException, path: str) -> str:
    """The innermost line of the user's file in the traceback (a syntax error: its own line)."""
    if isinstance(error, SyntaxError) and error.lineno:
        return f"line {error.lineno}"
    frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename == path]
    return f"line {frames[-1].lineno}, in {frames[-1].name}" if frames else ""


def _text(error: BaseException) -> str:
    try:
        return str(error)[:2000]
    except Exception:  # an exception class whose __str__ fails
        return "(its message could not be shown)"


def _number(value):
    """A value JSON can carry: numbers (numpy's via ``item()``), bools and None as they are,
    anything else described for the parent's message."""
    if isinstance(value, int) and value.bit_length() > 1024:
        # beyond any float, and too long for the parent's JSON reader to accept
        return {"type": "int", "repr": f"an integer of {value.bit_length()} bits"}
    if value is None or isinstance(value, bool | int | float):
        return value
    if hasattr(value, "item") and not isinstance(value, str | bytes | dict):
        try:
            plain = value.item()
        except (TypeError, ValueError):  # an array of more than one element
            plain = value
        if plain is None or isinstance(plain, bool | int | float):
            return plain
    return {"type": type(value).__name__, "repr": repr(value)[:_SHOWN]}


def _call(path: str, function: str, kwargs: dict) -> dict:
    stage = "import"
    try:
        module = _load(path)
        stage = "function"
        fn = getattr(module, function, None)
        if not callable(fn):
            defined = sorted(
                name
                for name, value in vars(module).items()
                if callable(value) and not name.startswith("_")
            )
            found = "missing" if fn is None else type(fn).__name__
            return {"error": {"stage": stage, "type": found, "message": ", ".join(defined[:12])}}
        stage = "call"
        result = fn(**kwargs)
        stage = "result"
        if hasattr(result, "tolist"):  # a numpy array
            result = result.tolist()
        if not isinstance(result, list | tuple):
            return {"error": {"stage": stage, "type": type(result).__name__, "message": ""}}
        return {"values": [_number(value) for value in result]}
    except MemoryError:
        # no traceback: its frames would keep what filled the memory alive while it is written
        return {"error": {"stage": stage, "type": "MemoryError", "message": "", "at": ""}}
    except BaseException as error:  # SystemExit and KeyboardInterrupt from user code too
        return {
            "error": {
                "stage": stage,
                "type": type(error).__name__,
                # a syntax error's own text repeats the file and line that "at" gives
                "message": error.msg if isinstance(error, SyntaxError) else _text(error),
                "at": _where(error, path),
            }
        }


def main() -> None:
    directory, limit = sys.argv[1], int(sys.argv[2])
    _limit_memory(limit)
    with open(os.path.join(directory, "call.json"), encoding="utf-8") as file:
        call = json.load(file)
    payload = _call(call["file"], call["function"], call["kwargs"])
    with open(os.path.join(directory, "result.json"), "w", encoding="utf-8") as file:
        json.dump(payload, file)
    sys.stderr.flush()
    sys.stdout.flush()
    # not a normal exit: a thread the user's code started must not keep the process alive
    os._exit(0)


if __name__ == "__main__":
    main()
