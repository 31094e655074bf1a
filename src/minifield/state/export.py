"""Exported weights: one .npy per parameter plus ``model.json`` (config and per-file sha256).

This is what users load to use a trained model, and what the store publishes. A second form
(:data:`FILES_FORMAT`, written by :func:`write_files`) keeps weights in files of another format
(a HuggingFace directory): ``model.json`` then lists every other file of the directory with its
sha256, and :func:`read` verifies them all and returns no arrays (the caller loads the files).
"""

from __future__ import annotations

import io
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from .. import atomic
from ..digest import sha256_bytes, sha256_file

MODEL_FILE = "model.json"
FORMAT = "minifield-export/1"
FILES_FORMAT = "minifield-export-files/1"


class ExportError(Exception):
    pass


class ExportWriteError(Exception):
    """An export could not be written (its partial directory was removed)."""


def write_whole(final: Path, write: Callable[[Path], object], group=None) -> None:
    """``final`` whole or not at all: ``write`` fills a temporary sibling, renamed into place
    once complete; a failed write is removed and raised as :class:`ExportWriteError` naming
    ``final`` and the error (which names the file, for a full disk).

    ``group``: the processes that write it together (a collective; ``final`` on a file
    system they all see): process 0 makes the temporary directory afresh, every process
    calls ``write``, and process 0 renames it once every process's ``write`` returned (a
    failure in any is raised in all, and the directory removed)."""
    partial = final.parent / f".{final.name}.partial"
    if group is None or group.size == 1:
        try:
            write(partial)
            _commit(partial, final, True)
        except Exception as exc:
            shutil.rmtree(partial, ignore_errors=True)
            raise _not_written(final, exc) from exc
        return
    failure = None
    if group.rank == 0:
        try:  # a partial directory a killed attempt left is not written into
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
        except OSError as exc:
            failure = exc
    failure = _together(group, failure, lambda: write(partial))
    if failure is None:  # the commit, process 0's, known to all
        failure = _together(group, None, lambda: _commit(partial, final, group.rank == 0))
    if failure is not None:
        if group.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        raise _not_written(final, failure) from failure


def _commit(partial: Path, final: Path, writer: bool) -> None:
    if writer:
        os.rename(partial, final)
        atomic.fsync_dir(final.parent)


def _together(group, failure: Exception | None, write: Callable[[], object]):
    """``write`` in every process once all agree that what came before succeeded; the first
    failure seen here (any process's made known by ``group.gather_ints``), or None."""
    failed = [rank for rank, bad in enumerate(group.gather_ints(failure is not None)) if bad]
    if failed:
        return failure or RuntimeError(f"process(es) {failed} failed")
    try:
        write()
    except Exception as exc:  # every process must reach the agreement below
        failure = exc
    failed = [rank for rank, bad in enumerate(group.gather_ints(failure is not None)) if bad]
    if failed:
        return failure or RuntimeError(f"process(es) {failed} failed writing it")
    return None


def _not_written(final: Path, exc: BaseException) -> ExportWriteError:
    return ExportWriteError(
        f"export {final} was not written (the partial one was removed): {type(exc).__name__}: {exc}"
    )


def write(directory: Path, params: dict[str, np.ndarray], config: dict[str, Any]) -> dict:
    """Write ``params`` (flat name → array) and ``config``; returns the model.json content."""
    (directory / "weights").mkdir(parents=True, exist_ok=True)
    entries = []
    for index, (name, array) in enumerate(sorted(params.items())):
        buffer = io.BytesIO()
        np.save(buffer, np.asarray(np.asarray(array, order="C")), allow_pickle=False)
        data = buffer.getvalue()
        file = weight_file(index)
        atomic.write_bytes(directory / file, data)
        entries.append(
            {
                "name": name,
                "file": file,
                "dtype": np.asarray(array).dtype.str,
                "shape": list(np.shape(array)),
                "sha256": sha256_bytes(data),
            }
        )
    model = {"format": FORMAT, "config": config, "weights": entries}
    atomic.write_json(directory / MODEL_FILE, model)
    return model


def weight_file(number: int) -> str:
    """The file of the ``number``-th array (in name order) of a :data:`FORMAT` export."""
    return f"weights/{number:05d}.npy"


def write_record(directory: Path, entries, config: dict[str, Any]) -> dict:
    """``model.json`` of a :data:`FORMAT` export whose ``.npy`` files are already written
    (by several processes, each its slices): ``entries`` ``(name, file, dtype str, shape)``
    in name order, each file's sha256 read back."""
    weights = [
        {
            "name": name,
            "file": file,
            "dtype": dtype,
            "shape": list(shape),
            "sha256": sha256_file(directory / file),
        }
        for name, file, dtype, shape in entries
    ]
    model = {"format": FORMAT, "config": config, "weights": weights}
    atomic.write_json(directory / MODEL_FILE, model)
    return model


def write_files(directory: Path, config: dict[str, Any]) -> dict:
    """``model.json`` for a directory whose files are already written: each file (every file
    under ``directory`` but ``model.json``) with its size and sha256, plus ``config``."""
    files = []
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        rel = path.relative_to(directory).as_posix()
        if rel == MODEL_FILE or path.name.startswith("."):
            continue
        # streamed: a weights shard is never held whole in memory
        files.append({"file": rel, "size": path.stat().st_size, "sha256": sha256_file(path)})
    model = {"format": FILES_FORMAT, "config": config, "files": files}
    atomic.write_json(directory / MODEL_FILE, model)
    return model


def _model(directory: Path) -> dict:
    model_path = directory / MODEL_FILE
    if not model_path.is_file():
        raise ExportError(f"{model_path}: missing (not an exported model directory)")
    return atomic.read_json(model_path)


def verify_files(directory: Path, which: Callable[[str], bool] = lambda _: True) -> None:
    """Every file a :data:`FILES_FORMAT` export lists (those ``which`` selects, by relative
    name) present and of the sha256 ``model.json`` records; raises ExportError naming the
    first that is not. Streamed: a file is never held whole in memory."""
    model_path = directory / MODEL_FILE
    for entry in _model(directory).get("files", []):
        if not which(entry["file"]):
            continue
        file = directory / entry["file"]
        if not file.is_file():
            raise ExportError(f"{file}: missing (listed in {model_path})")
        if sha256_file(file) != entry["sha256"]:
            raise ExportError(f"{file}: sha256 mismatch with {model_path}")


def read(
    directory: Path, later: Callable[[str], bool] | None = None
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Load and verify exported weights; raises ExportError naming the bad file.

    A :data:`FILES_FORMAT` export has every listed file verified and gives no arrays; the files
    ``later`` selects (by relative name) are left to the caller, which verifies them with
    :func:`verify_files` (while it reads them, say) before it uses what it read."""
    model = _model(directory)
    if model.get("format") == FILES_FORMAT:
        verify_files(directory, lambda name: later is None or not later(name))
        return {}, model["config"]
    model_path = directory / MODEL_FILE
    if model.get("format") != FORMAT:
        raise ExportError(f"{model_path}: format {model.get('format')!r}, expected {FORMAT!r}")
    params = {}
    for entry in model["weights"]:
        file = directory / entry["file"]
        if not file.is_file():
            raise ExportError(f"{file}: missing weight file for {entry['name']!r}")
        data = file.read_bytes()
        if sha256_bytes(data) != entry["sha256"]:
            raise ExportError(f"{file}: sha256 mismatch for weight {entry['name']!r}")
        params[entry["name"]] = np.load(io.BytesIO(data), allow_pickle=False)
    return params, model["config"]
