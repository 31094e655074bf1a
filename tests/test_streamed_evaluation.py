"""The store's re-evaluation of a large export a layer at a time (``minifield.models.streamed``
over ``hf.directory.LayerFiles``, ``training.evaluator.StreamedEvaluator``).

References: the whole-model path the gate takes for an export that fits (``Evaluator`` over
the parameters in memory, ``model.greedy_generate_batch``), which must agree bit for bit
where the arithmetic per layer is the same program: in FP32 always; in BF16 once XLA may not
keep values in more precision than their dtype (``--xla_allow_excess_precision=false``):
within one program XLA's CPU carries the BF16 residual stream in FP32 between layers, a
layer's own program rounds it to BF16 at its end, so with the default flags the two differ in
the last bits (docs/store-and-capacity.md). And what is read: each layer's tensors, read and
held only while that layer runs.
"""

from __future__ import annotations

import copy
import gc
import json
import os
import subprocess
import sys
import weakref
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import PRODUCTION, compiled_as
from test_hf_export import tiny_llama, write_packed_sft_export

from minifield.data.packing import Rows
from minifield.hf import checkpoint as hf_checkpoint
from minifield.hf import directory as hf_directory
from minifield.models import model, streamed
from minifield.training.evaluator import Evaluator, StreamedEvaluator

PAD, EOS = 256, 258
LAYERS = 3


def write_export(directory: Path, cfg, params) -> dict:
    """``params`` as an HF export (FP32, in shards smaller than a layer); its ``model.json``
    config."""
    return write_packed_sft_export(directory, cfg, params, "float32", max_shard_size=20000)


def rows_and_prompts(seed=0, n=5, length=48):
    """Packed rows (two examples and padding in each, a batch of 2 leaves the last padded)
    and three prompts of different lengths."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 256, (n, length)).astype(np.int32)
    segments = np.zeros((n, length), np.int32)
    segments[:, :20], segments[:, 20:41] = 1, 2
    positions = np.zeros((n, length), np.int32)
    positions[:, :20], positions[:, 20:41] = np.arange(20), np.arange(21)
    loss_mask = ((rng.random((n, length)) < 0.6) & (segments > 0)).astype(np.float32)
    prompts = [tokens[0, :5].tolist(), tokens[1, :9].tolist(), tokens[2, :3].tolist()]
    return Rows(tokens, segments, positions, loss_mask), prompts


def figures(evaluator, params, cfg, streamed_weights=None) -> dict:
    """The loss of :func:`rows_and_prompts`'s rows and the greedy tokens of its prompts (in
    two chunks)."""
    rows, prompts = rows_and_prompts()
    chunks = [prompts[:2], prompts[2:]]  # two buffers of different lengths
    if streamed_weights is None:
        tokens = [model.greedy_generate_batch(params, cfg, c, 12, EOS) for c in chunks]
    else:
        tokens = streamed.Streamed(cfg).greedy(streamed_weights, chunks, 12, EOS)
    return {"loss": evaluator.loss(streamed_weights or params, rows)["loss"], "tokens": tokens}


@pytest.mark.slow  # compiles the loss, each layer and generation twice (~5 s)
def test_a_layer_at_a_time_gives_the_whole_models_figures_and_sees_a_changed_layer(tmp_path):
    cfg, params = tiny_llama(n_layers=LAYERS)
    config = write_export(tmp_path / "export", cfg, params)
    loaded, files = hf_directory.load(tmp_path / "export", config, streamed=True)
    assert loaded == cfg and isinstance(files, hf_directory.LayerFiles)
    whole = figures(Evaluator(cfg, 2, EOS, PAD), params, cfg)
    layered = figures(StreamedEvaluator(cfg, 2, EOS, PAD), None, cfg, files)
    assert layered == whole  # FP32: the same program per layer, bit for bit

    # one weight of the middle layer changed: the streamed figures follow the file
    changed = copy.deepcopy(params)
    changed["blocks"]["01"]["mlp"]["w_down"][3, 5] += 0.5
    config = write_export(tmp_path / "changed", cfg, changed)
    _, files = hf_directory.load(tmp_path / "changed", config, streamed=True)
    got = figures(StreamedEvaluator(cfg, 2, EOS, PAD), None, cfg, files)
    assert got["loss"] != whole["loss"]
    assert got == figures(Evaluator(cfg, 2, EOS, PAD), changed, cfg)


class Watched(hf_directory.LayerFiles):
    """LayerFiles that records which layers it gave, and the bytes of the layers' arrays
    still alive (a finalizer per array) whenever it is asked for the next."""

    def __init__(self, directory, cfg):
        super().__init__(directory, cfg)
        self.given: list[int] = []
        self.alive = {"bytes": 0}
        self.peak = 0

    def layer(self, index: int) -> dict:
        # what nothing refers to any more is gone before we count: the young generations,
        # where a cycle made since the last layer lies (a full collection took up to 0.4 s in
        # a worker that had run many tests); garbage left uncollected could only raise the
        # count, failing the check, never passing it wrongly
        gc.collect(1)
        block = super().layer(index)
        for leaf in jax.tree_util.tree_leaves(block):
            self.alive["bytes"] += leaf.nbytes
            weakref.finalize(leaf, _forget, self.alive, leaf.nbytes)
        self.peak = max(self.peak, self.alive["bytes"])
        self.given.append(index)
        return block


def _forget(alive: dict, nbytes: int) -> None:
    alive["bytes"] -= nbytes


@pytest.mark.slow  # compiles each layer's program and generation (~3 s)
def test_no_more_than_one_layers_tensors_are_read_or_held_at_once(tmp_path, monkeypatch):
    cfg, params = tiny_llama(n_layers=LAYERS)
    config = write_export(tmp_path / "export", cfg, params)
    hf_directory.load(tmp_path / "export", config, streamed=True)  # the checks, as the gate
    read: list[str] = []
    original = hf_checkpoint.read_fp32

    def recording(*args):
        read.append(args[-1])  # the tensor's name
        return original(*args)

    monkeypatch.setattr(hf_checkpoint, "read_fp32", recording)
    files = Watched(tmp_path / "export", cfg)
    layer_bytes = [
        sum(np.asarray(leaf).nbytes for leaf in jax.tree_util.tree_leaves(params["blocks"][n]))
        for n in sorted(params["blocks"])
    ]
    # each layer's reads are its own tensors, and nothing else
    for index in range(LAYERS):
        read.clear()
        block = files.layer(index)
        assert read and all(name.startswith(f"model.layers.{index}.") for name in read)
        assert len(read) == len(jax.tree_util.tree_leaves(params["blocks"][f"{index:02d}"]))
        del block
    files.given.clear()
    files.peak = 0

    rows, prompts = rows_and_prompts()
    StreamedEvaluator(cfg, 2, EOS, PAD).loss(files, rows)
    assert files.given == list(range(LAYERS))  # each layer read once for every batch
    assert 0 < files.peak <= max(layer_bytes)  # the last one let go before the next is read
    files.given.clear()
    tokens = streamed.Streamed(cfg).greedy(files, [prompts[:1], prompts[1:2]], 4, None)
    assert len(tokens[0][0]) == len(tokens[1][0]) == 4
    assert files.given == list(range(LAYERS)) * 4  # once per new token, for both chunks
    assert files.peak <= max(layer_bytes)


def _bf16_figures() -> list:
    """In this process (compiled as production, no excess precision): the whole-model and the
    streamed figures of a BF16 model, as JSON."""
    import tempfile

    cfg, params = tiny_llama(compute_dtype="bfloat16", n_layers=LAYERS)
    with tempfile.TemporaryDirectory() as tmp:
        config = write_export(Path(tmp) / "export", cfg, params)
        _, files = hf_directory.load(Path(tmp) / "export", config, streamed=True)
        layered = figures(StreamedEvaluator(cfg, 2, EOS, PAD), None, cfg, files)
    return [figures(Evaluator(cfg, 2, EOS, PAD), params, cfg), layered]


@pytest.mark.slow  # a process compiled as production
def test_in_bf16_the_layers_programs_are_the_whole_models_without_excess_precision():
    env = {**os.environ, **compiled_as(PRODUCTION)}
    env["XLA_FLAGS"] = f"{env['XLA_FLAGS']} --xla_allow_excess_precision=false".strip()
    code = (
        "import json, sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "import test_streamed_evaluation as t\n"
        "print(json.dumps(t._bf16_figures()))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    whole, layered = json.loads(proc.stdout.strip().splitlines()[-1])
    assert layered == whole
