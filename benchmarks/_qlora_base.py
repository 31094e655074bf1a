"""``qlora_step.py``'s base in ``--dir`` and its quantized products beside it, made once and
kept: the random base (``_random_base.py``) and, per scheme, its codes and scales in the
quantized-base product's format (:func:`minifield.hf.quantized_base.write`, under
``--dir/quantized/``, addressed by the base's description and the settings), so the kernel
variants of a scheme, and a later call, read one quantization. The parent makes the products
in a thread of its own (:class:`Products`) while a mode's process runs; each mode's process
maps the base (:func:`minifield.hf.checkpoint.map_stored`: nothing read that it does not place)
and reads its scheme's product verified, as a worker started with a quantized-base product
does. No JAX here: the parent never starts a backend.
"""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import _random_base

from minifield.digest import sha256_file, sha256_json
from minifield.hf import checkpoint, quantized_base, shards, stored_base
from minifield.inputs import examples

#: bumped when ``_random_base`` draws other values from the same seed
DRAW = "inverse transform of PCG64 words/1"


def write_base(directory: Path, cfg) -> float | None:
    """The random base of ``cfg`` in ``directory`` unless it holds one (``config.json`` is
    written last), any products of an earlier base removed first; its seconds, None: kept."""
    if (directory / checkpoint.CONFIG_FILE).is_file():
        return None
    start = time.perf_counter()
    shutil.rmtree(directory / "quantized", ignore_errors=True)
    _random_base.write(directory, cfg, seed=0, dtype="bfloat16")
    return time.perf_counter() - start


def settings(scheme: str, block: int | None, no_double: bool) -> tuple:
    """``(scheme, effective block, double)`` as :func:`quantized_base.settings` gives them."""
    if scheme == "nf4" and block is None:
        block = quantized_base.NF4_BLOCK
    return scheme, block, scheme == "nf4" and not no_double


def _described(directory: Path, found: tuple) -> dict:
    scheme, block, double = found
    pins = [checkpoint.CONFIG_FILE, shards.INDEX_FILE]
    return {
        "what": "qlora_step random base, quantized",
        "version": quantized_base.VERSION,
        "base": {name: sha256_file(directory / name) for name in pins},
        "draw": DRAW,
        "seed": 0,
        "scheme": scheme,
        "block": block,
        "double_quantization": double,
    }


def product_dir(directory: Path, found: tuple) -> Path:
    scheme, block, double = found
    return directory / "quantized" / f"{scheme}-{block or 'channel'}-{'dq' if double else 'plain'}"


def make_product(directory: Path, found: tuple) -> float | None:
    """The product of ``found`` in ``--dir`` unless it is there; its seconds, None: kept."""
    out = product_dir(directory, found)
    if (out / examples.MANIFEST).is_file():
        return None
    start = time.perf_counter()
    shutil.rmtree(out, ignore_errors=True)  # a half-written one (no manifest)
    _, params, layout = checkpoint.map_stored(directory)
    quantized_base.write(
        stored_base.to_arrays(params, layout), out, found, _described(directory, found)
    )
    return time.perf_counter() - start


def arrays(directory: Path, seq: int, found: tuple | None) -> dict:
    """A mode's arrays: the base mapped, and ``found``'s product verified (None: BF16)."""
    _, params, layout = checkpoint.map_stored(directory, seq, "bfloat16")
    out = stored_base.to_arrays(params, layout)
    if found is not None:
        address = sha256_json(_described(directory, found))
        out.update(quantized_base.read(product_dir(directory, found), address))
    return out


class Products:
    """The products of ``found`` (in order) made by a daemon thread (a parent out of time
    exits without waiting for it); :meth:`wait` for one, with a timeout."""

    def __init__(self, directory: Path, founds: list[tuple]):
        self.done = {found: threading.Event() for found in founds}
        self.seconds: dict = {}
        self.errors: dict = {}

        def run() -> None:
            for found in founds:
                try:
                    self.seconds[found] = make_product(directory, found)
                except Exception as exc:  # reported for the modes that need it
                    self.errors[found] = f"{type(exc).__name__}: {exc}"
                self.done[found].set()

        threading.Thread(target=run, daemon=True, name="quantize").start()

    def wait(self, found: tuple, timeout: float | None) -> str | None:
        """None once ``found``'s product is there; else why not (``timeout`` None: none)."""
        if not self.done[found].wait(timeout):
            return "out of time while its base was quantized"
        return self.errors.get(found)
