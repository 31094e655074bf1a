"""A LoRA run's merged export made on the host tensor by tensor
(:mod:`minifield.training.host_merge`), and a quantized base's evaluation on its codes
(docs/quantized-base.md).

The export is checked against the export as it was written before (the whole merge jitted,
:func:`minifield.training.lora.merged`, then written; the code is repeated here), byte for byte,
and against ``W + (alpha / rank) * B @ A`` in float64 NumPy from the base file and the adapter
file read back. The quantized base's DEV loss is checked against the same loss of a model
whose matrices are the float64 NumPy reference's dequantized ones (``test_quantize``), the
adapters beside them.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file
from test_base_model import _prepare, make_inputs
from test_lora import LORA, lora_recipe
from test_quantized_base import _nf4_reference

from minifield.data.packing import Rows
from minifield.hf import pinned_base, stored_base
from minifield.models.layers import layer_stack
from minifield.strategies.lm import export_format
from minifield.training import lora

#: 7 / 3 is no power of two: the merge's multiply and add round differently unfused
SECTION = {**LORA, "rank": 3, "alpha": 7.0, "base_dtype": "bfloat16"}
NF4 = {"base_quantization": "nf4", "quantization_block": 16, "double_quantization": True}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("host-merge") / "in"
    make_inputs(root)
    return root


def _trained(root, section, evaluation=None):
    recipe = lora_recipe(root, section)
    recipe["evaluation"].update(evaluation or {})
    loaded, (arrays, _) = _prepare(recipe, root)
    program = loaded.strategy.build(loaded.data, arrays)
    state = program.place(program.init_state())
    for _ in range(3):
        state, _ = program.step(state)
    return program, state


def _export_as_before(program, state, directory):
    """The export as the program wrote it before the host merge: every merged weight made
    by one jitted :func:`lora.merged` (into the unquantized base), then written."""
    adapters = layer_stack.per_layer(state["params"])
    base = stored_base.on_host(program.arrays, program.lora.base_dtype)
    merged = jax.jit(lambda b, a: lora.merged(b, a, program.lora))(base, adapters)
    export_format.write(
        directory,
        program.recipe,
        program.arrays,
        program.cfg,
        program.tokenizer,
        merged,
        (program.lora, adapters),
        program.export_strategy,
        program.export_files(),
    )


@pytest.mark.parametrize(
    ("section", "evaluation"),
    [
        pytest.param(SECTION, {}, marks=pytest.mark.slow),
        pytest.param(
            {**SECTION, "base_dtype": "float32"},
            {"export_dtype": "bfloat16"},
            marks=pytest.mark.slow,
        ),
        # slow too (2.9 s under 3.12): the fast tier's host merge is test_frozen_base's exports
        pytest.param({**SECTION, **NF4}, {}, marks=pytest.mark.slow),
    ],
    ids=["bf16-base", "fp32-base-bf16-export", "nf4"],
)
def test_the_host_merge_writes_the_export_of_before_byte_for_byte(
    root, tmp_path, section, evaluation
):
    program, state = _trained(root, section, evaluation)
    program.export(state, tmp_path / "host")
    _export_as_before(program, state, tmp_path / "before")
    files = sorted(p.relative_to(tmp_path / "before") for p in (tmp_path / "before").rglob("*"))
    assert files == sorted(p.relative_to(tmp_path / "host") for p in (tmp_path / "host").rglob("*"))
    for name in files:
        if (tmp_path / "before" / name).is_file():
            before = (tmp_path / "before" / name).read_bytes()
            assert (tmp_path / "host" / name).read_bytes() == before, name
    # and what it holds is W + scale * B @ A from the files (float64 NumPy)
    base = load_file(str(root / "base" / "model.safetensors"))
    adapter = load_file(str(tmp_path / "host" / "adapter" / "adapter_model.safetensors"))
    merged = load_file(str(tmp_path / "host" / "model.safetensors"))
    exported = evaluation.get("export_dtype", "float32")
    tolerance = 1e-2 if exported == "bfloat16" or section["base_dtype"] == "bfloat16" else 1e-6
    changed = 0
    for name, w in base.items():
        module = f"base_model.model.{name[: -len('.weight')]}"
        expected = w.astype(np.float64)
        if f"{module}.lora_A.weight" in adapter:
            a = adapter[f"{module}.lora_A.weight"].astype(np.float64)
            b = adapter[f"{module}.lora_B.weight"].astype(np.float64)
            expected = expected + section["alpha"] / section["rank"] * (b @ a)
            changed += 1
        got = merged[name].astype(np.float64)
        np.testing.assert_allclose(got, expected, rtol=tolerance, atol=tolerance, err_msg=name)
    assert changed == 2 * 4  # two layers, four targets


@pytest.mark.slow
def test_a_quantized_base_is_evaluated_on_its_codes(root):
    """DEV scores the model training's forward runs (the NF4 base made back in each layer,
    the adapters beside it): its loss is the one of the reference's dequantized matrices,
    not the one of the unquantized base."""
    program, state = _trained(root, {**SECTION, **NF4, "base_dtype": "float32"})
    ours = program.evaluate(state)["dev_loss"]
    adapters = jax.tree_util.tree_map(np.asarray, layer_stack.per_layer(state["params"]))
    unquantized = pinned_base.params_from_arrays(program.arrays)
    reference = jax.tree_util.tree_map(np.array, unquantized)
    for block in reference["blocks"].values():
        for group in block.values():
            for name, w in group.items():
                if np.ndim(w) == 2:
                    group[name] = _nf4_reference(np.asarray(w)).astype(np.float32)

    def dev_loss(params):
        merged = lora.merged(
            jax.tree_util.tree_map(jax.numpy.asarray, params), adapters, program.lora
        )
        return program.evaluator.loss(merged, Rows.of(program.arrays, "dev"))["loss"]

    expected, unquantized_loss = dev_loss(reference), dev_loss(unquantized)
    # the two models' losses differ by 2e-4 here (relative 4e-5); ours is the reference's
    # to float32 rounding (the matrices made back in another order of operations)
    np.testing.assert_allclose(ours, expected, rtol=5e-6)
    assert abs(unquantized_loss - expected) > 1e-4


@pytest.mark.parametrize(("n_in", "n_out", "rank"), [(48, 64, 3), (32, 16, 4), (256, 384, 16)])
def test_a_matrix_merged_in_its_stored_layout_has_the_bits_of_the_transposed_one(n_in, n_out, rank):
    """The ``[out, in]`` merge (the base as stored, never copied into ``[in, out]``) gives the
    bits of :func:`lora.merged`'s ``[in, out]`` expression. At the first two shapes a
    transposed product left free to XLA (its operands swapped: another kernel) differed in
    the last bit of some values under JAX 0.10.2."""
    from minifield.training import host_merge

    rng = np.random.default_rng(n_in)
    w = rng.standard_normal((n_out, n_in), dtype=np.float32)
    a = rng.standard_normal((n_in, rank), dtype=np.float32) * 0.1
    b = rng.standard_normal((rank, n_out), dtype=np.float32) * 0.1
    scale = 7.0 / 3.0
    stored_layout, _ = host_merge._merge_op(scale, out_in=True)
    precision = jax.lax.Precision.HIGHEST  # lora.merged's per-target expression, [in, out]
    expected = jax.jit(lambda w, a, b: w + scale * jax.numpy.matmul(a, b, precision=precision))
    ours = np.asarray(stored_layout(w, a, b)).T
    reference = np.asarray(expected(np.ascontiguousarray(w.T), a, b))
    np.testing.assert_array_equal(ours.view(np.uint32), reference.view(np.uint32))


def test_the_merged_export_benchmark_finds_both_writers_bytes_equal(capsys):
    """``benchmarks/merged_export.py`` at a small shape: the writer as it is and as it was
    write the same bytes (the benchmark stops otherwise), and it prints both timings."""
    import json
    import sys

    from conftest import REPO

    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import merged_export
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    small = ["--d-model", "128", "--d-ff", "256", "--layers", "2", "--vocab", "300"]
    assert merged_export.main([*small, "--rank", "4", "--shard", "100000", "--rounds", "1"]) == 0
    printed = json.loads(capsys.readouterr().out)
    # BF16: two bytes a parameter (embeddings, head, 2 layers' 7 matrices and 2 norms, the
    # final norm), beside the safetensors headers of the shards
    parameters = 2 * 300 * 128 + 2 * (4 * 128 * 128 + 3 * 128 * 256 + 2 * 128) + 128
    assert 2 * parameters < printed["export_bytes"] < 2 * parameters + 20_000
    assert set(printed["seconds"]) == {"before", "now"}


def _resident_file_kb() -> int:
    """This process's resident pages of mapped files (``RssFile``), in KiB."""
    for line in open("/proc/self/status"):  # noqa: SIM115 - read at once
        if line.startswith("RssFile:"):
            return int(line.split()[1])
    pytest.skip("no RssFile in /proc/self/status (not Linux)")


def test_a_mapped_base_tensor_read_is_released_from_the_process(tmp_path):
    """``stored_base.release`` drops a memory-mapped array's pages from this process (they
    count as its memory on the chip's host), only that array's range, and the values read
    after are the file's."""
    rows, cols = 512, 32 * 1024  # two 32 MiB halves of float32
    expected = np.random.default_rng(0).standard_normal((rows, cols), np.float32)
    np.save(tmp_path / "base.npy", expected)
    mapped = np.load(tmp_path / "base.npy", mmap_mode="r")
    first, second = mapped[: rows // 2], mapped[rows // 2 :].T  # a transposed view too
    before = _resident_file_kb()
    assert float(np.asarray(mapped, np.float64).sum()) == pytest.approx(
        expected.sum(dtype=np.float64)
    )
    read_all = _resident_file_kb()
    assert read_all - before > 60 * 1024  # the 64 MiB were mapped in
    stored_base.release(first)
    assert read_all - _resident_file_kb() > 30 * 1024  # its 32 MiB left the process
    stored_base.release(second)
    assert _resident_file_kb() - before < 1024  # the rest, within a page or two
    np.testing.assert_array_equal(mapped, expected)  # read again from the page cache
    stored_base.release(expected)  # an array in memory: nothing happens
    np.testing.assert_array_equal(mapped, expected)


def test_the_host_merge_releases_every_base_tensor_it_reads(root, monkeypatch, tmp_path):
    """The merged export reads every base tensor once from the prepared arrays, memory-mapped
    as a run loads them (``examples.load``), and releases each once merged (what releasing
    does: the test above)."""
    from minifield.training.host_merge import HostMerge, _Tensor

    loaded, (prepared, _) = _prepare(lora_recipe(root, SECTION), root)
    program = loaded.strategy.build(loaded.data, prepared)
    state = program.init_state()  # untrained adapters: the merge reads the same base
    mapped = {}
    for name, value in program.arrays.items():
        np.save(tmp_path / f"{name}.npy", value)
        mapped[name] = np.load(tmp_path / f"{name}.npy", mmap_mode="r")
    merge = HostMerge(mapped, layer_stack.per_layer(state["params"]), program.lora)
    released = []
    monkeypatch.setattr(stored_base, "release", released.append)
    for path in merge.stored:
        merge.value(_Tensor(path))
    assert [id(value) for value in released] == [id(merge.stored[p]) for p in merge.stored]
    owners = {type(_owner(value)).__name__ for value in released}
    assert owners == {"mmap"}, owners  # each a view of the prepared file's mapping


def _owner(value):
    while isinstance(value, np.ndarray):
        value = value.base
    return value
