"""The three public loads ``hf_load.py`` measures beside the frozen base, and the files they
read: ``minifield.load_model`` on an HF directory, the start of a full fine-tune from the
prepared base, and the evaluate stage's export load (``ExportedModel``, what the harness and
the store's gate open). Each side is a script run in a fresh subprocess (``hf_load.py``'s
``PRELUDE`` before it), measured against a raw read of the very files it reads."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

#: ``minifield.load_model`` of the HF directory (its tokenizer files written beside the weights)
LOAD_MODEL = """
import minifield
model = minifield.load_model(sys.argv[1])
jax.block_until_ready(model.params)
done(start, before)
"""

#: a full fine-tune's start: the prepared examples verified (every file's sha256) and
#: memory-mapped, the base widened and transposed to the FP32 masters, the step-0 state made
#: from them (``initial_state.state_from_params``; plain SGD, whose optimizer state holds no
#: array, so the figure is the weights' and not AdamW's two zero moments)
FULL_START = """
from pathlib import Path
import optax
from minifield.inputs import examples
from minifield.hf import pinned_base
from minifield.training.initial_state import state_from_params
arrays, _ = examples.load(Path(sys.argv[1]).parent / "prepared")
verified = time.perf_counter()
host = pinned_base.params_from_arrays(arrays)
state = state_from_params(host, optax.sgd(0.1), 0)
jax.block_until_ready(state)
done(start, before, verify_seconds=verified - start)
"""

#: the evaluate stage's export load: every listed file's sha256 checked, the weights read
EXPORT_LOAD = """
from pathlib import Path
from minifield.strategies.lm.export_format import ExportedModel
model = ExportedModel(Path(sys.argv[1]).parent / "export")
jax.block_until_ready(model.params)
done(start, before)
"""

#: the raw read of the files a side reads, into one buffer allocated before the clock
READ_FILES = """
import json, os, resource, sys, time
paths = sys.argv[2:]
size = max(os.path.getsize(p) for p in paths)
buffer = bytearray(size)
view = memoryview(buffer)
total = 0
usage = resource.getrusage(resource.RUSAGE_SELF)
cpu_before = usage.ru_utime + usage.ru_stime
start = time.perf_counter()
for path in paths:  # each file as hf_load.py's READ reads one: into the buffer, 16 MiB a call
    done, size = 0, os.path.getsize(path)
    with open(path, "rb", buffering=0) as f:
        while done < size:
            done += f.readinto(view[done : done + (16 << 20)])
    total += done
usage = resource.getrusage(resource.RUSAGE_SELF)
cpu = usage.ru_utime + usage.ru_stime - cpu_before
print(json.dumps({"seconds": time.perf_counter() - start, "cpu": cpu, "bytes": total}))
"""


def write_tokenizer(directory: Path, max_len: int) -> None:
    """The built-in byte tokenizer as ``tokenizer.json`` + ``tokenizer_config.json`` (what
    ``load_model`` needs beside the weights)."""
    from minifield.data import tokenizer as tokenizers
    from minifield.hf import directory as hf_directory

    (directory / hf_directory.TOKENIZER_FILE).write_bytes(hf_directory.byte_tokenizer_json())
    config = hf_directory.tokenizer_config(tokenizers.byte_tokenizer(), max_len)
    (directory / hf_directory.TOKENIZER_CONFIG_FILE).write_text(json.dumps(config))


def write_export(directory: Path) -> Path:
    """An export of the HF directory ``directory`` (``directory/../export``): its files (the
    weights hard-linked: the same bytes, the same page cache), a DEV copy and ``model.json``
    listing every file with its sha256, as ``hf.directory.write`` lays an export out."""
    from minifield.digest import sha256_bytes
    from minifield.hf import checkpoint as hf_checkpoint
    from minifield.hf import directory as hf_directory
    from minifield.state import export

    out = directory.parent / "export"
    out.mkdir()
    for path in directory.iterdir():
        if path.name == hf_checkpoint.SINGLE_FILE:
            os.link(path, out / path.name)
        else:
            shutil.copyfile(path, out / path.name)
    (out / "dev.jsonl").write_bytes(b"")
    hf = json.loads((directory / hf_checkpoint.CONFIG_FILE).read_text())
    cfg = hf_checkpoint.config_from_hf(hf, compute_dtype="float32")
    export.write_files(
        out,
        {
            "strategy": {"name": "packed-sft", "version": "12.0.0"},
            "model": cfg.to_dict(),
            "tokenizer": {"kind": "byte", "vocab_size": 260},
            "layout": "<bos> prompt <sep> response <eos>",
            "dev": {"file": "dev.jsonl", "sha256": sha256_bytes(b"")},
            "weights": {"format": hf_directory.WEIGHTS_FORMAT, "dtype": hf.get("torch_dtype")},
        },
    )
    return out


def read_files(directory: Path) -> dict[str, list[str]]:
    """Per side, the files it reads (its raw-read baseline reads the same)."""
    root = directory.parent
    prepared = json.loads((root / "prepared" / "manifest.json").read_text())["arrays"]
    listed = json.loads((root / "export" / "model.json").read_text())["files"]
    return {
        "load_model": [str(directory / "model.safetensors")],
        "full_start": [str(root / "prepared" / e["file"]) for e in prepared],
        "export_load": [str(root / "export" / e["file"]) for e in listed],
    }
