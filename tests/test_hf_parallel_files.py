"""The writer of safetensors files by slices (``minifield.hf.parallel_files``), in one process:
its header is the ``safetensors`` library's byte for byte, a slice lands where NumPy puts it,
and an export written through it equals the whole-tensor writer's. Several processes:
tests/test_export_shards.py."""

from __future__ import annotations

import os

import jax
import ml_dtypes
import numpy as np
import pytest
from export_shards_probe import PHI3, host_params
from safetensors.numpy import save
from test_hf_shards import numpy_params

from minifield.hf import checkpoint as hf_checkpoint
from minifield.hf import parallel_files
from minifield.supervision.distributed import Group
from minifield.training import lora, peft_adapter

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_the_header_is_the_safetensors_librarys(dtype):
    rng = np.random.default_rng(0)
    shapes = {
        "model.layers.10.mlp.down_proj.weight": (3, 5),
        "model.layers.2.mlp.down_proj.weight": (5, 3),
        "lm_head.weight": (7, 1),
        "b": (4,),
        "A": (2, 3, 2),
        "z.empty": (0, 3),
    }
    tensors = {n: rng.standard_normal(s).astype(DTYPES[dtype]) for n, s in shapes.items()}
    # one metadata entry (the library orders several as its hash map happens to)
    for metadata in ({"format": "pt"}, {"format": "p" * 6}):
        expected = save(tensors, metadata=metadata)
        head, offsets, size = parallel_files.header(shapes, dtype, metadata)
        assert size == len(expected)
        assert expected.startswith(head)
        for name, value in tensors.items():
            at = offsets[name]
            assert expected[at : at + value.nbytes] == value.tobytes(), name


def test_a_block_lands_where_numpy_puts_it(tmp_path):
    rng = np.random.default_rng(1)
    path = tmp_path / "file"
    for shape, starts, block_shape in [
        ((6, 8), (0, 2), (6, 3)),  # columns: one range per row
        ((6, 8), (2, 0), (3, 8)),  # whole rows: one range
        ((4, 5, 6), (1, 2, 0), (2, 2, 6)),
        ((4, 5, 6), (0, 0, 3), (4, 5, 2)),
        ((9,), (4,), (3,)),
    ]:
        offset = 13  # the data need not start aligned
        before = rng.standard_normal(shape).astype(ml_dtypes.bfloat16)
        path.write_bytes(b"h" * offset + before.tobytes())
        block = rng.standard_normal(block_shape).astype(ml_dtypes.bfloat16)
        fd = os.open(path, os.O_WRONLY)
        try:
            parallel_files.write_block(fd, offset, shape, starts, block)
        finally:
            os.close(fd)
        expected = before.copy()
        expected[tuple(slice(s, s + n) for s, n in zip(starts, block_shape, strict=True))] = block
        assert path.read_bytes() == b"h" * offset + expected.tobytes(), (shape, starts)


@pytest.mark.parametrize("on_device", [False, True])
def test_an_export_written_by_slices_is_the_whole_tensor_writers(tmp_path, on_device):
    cases = [
        ("llama", *numpy_params(qkv_bias=True), "bfloat16", 6000),
        ("phi3", *host_params(PHI3, 1), "float16", None),  # fused matrices
    ]
    group = Group()  # one process: the same writer, its agreements local
    for name, cfg, params, dtype, size in cases:
        placed = jax.device_put(params) if on_device else params
        hf_checkpoint.write(tmp_path / name / "whole", cfg, params, dtype, None, size)
        hf_checkpoint.write(tmp_path / name / "slices", cfg, placed, dtype, None, size, group=group)
        whole = sorted((tmp_path / name / "whole").iterdir())
        slices = sorted((tmp_path / name / "slices").iterdir())
        assert [p.name for p in whole] == [p.name for p in slices]
        assert len(whole) > (3 if size else 1)
        for a, b in zip(whole, slices, strict=True):
            assert a.read_bytes() == b.read_bytes(), (name, a.name)


def test_a_peft_adapter_written_by_slices_is_the_whole_tensor_writers(tmp_path):
    cfg, _ = numpy_params()
    settings = lora.LoraSettings(2, 4.0, ("q_proj", "v_proj", "down_proj"))
    rng = np.random.default_rng(2)
    adapters = jax.tree_util.tree_map(
        lambda x: rng.standard_normal(x.shape).astype(np.float32),
        lora.init_adapters(cfg, settings, jax.random.key(0)),
    )
    peft_adapter.write_adapter(tmp_path / "whole", settings, adapters, "base", cfg)
    placed = jax.device_put(adapters)
    peft_adapter.write_adapter(tmp_path / "slices", settings, placed, "base", cfg, Group())
    for name in (peft_adapter.ADAPTER_WEIGHTS_FILE, peft_adapter.ADAPTER_CONFIG_FILE):
        assert (tmp_path / "whole" / name).read_bytes() == (tmp_path / "slices" / name).read_bytes()


def test_a_file_that_cannot_be_laid_out_is_named(tmp_path):
    (tmp_path / "model.safetensors").mkdir()  # a directory where the file goes
    files = {
        "model.safetensors": {
            "w": parallel_files.Tensor((2, 2), (parallel_files.Source(np.ones((2, 2))),))
        }
    }
    with pytest.raises(OSError, match="model.safetensors"):
        parallel_files.write(tmp_path, files, "float32", {"format": "pt"}, Group())


def test_a_streamed_file_is_the_librarys_and_a_failed_one_leaves_nothing(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(5)
    tensors = {f"t{i}": rng.standard_normal((3 + i, 5), np.float32) for i in range(6)}
    shapes = {name: value.shape for name, value in tensors.items()}
    stored = ("float32", {"format": "pt"})
    with ThreadPoolExecutor(3) as pool:
        parallel_files.write_streamed(
            tmp_path / "a.safetensors", shapes, *stored, tensors.get, pool
        )
        assert (tmp_path / "a.safetensors").read_bytes() == save(tensors, {"format": "pt"})

        def failing(name):
            if name == "t4":
                raise ValueError("no t4")
            return tensors[name]

        with pytest.raises(ValueError, match="no t4"):
            parallel_files.write_streamed(
                tmp_path / "b.safetensors", shapes, *stored, failing, pool
            )
        wrong = {**tensors, "t2": tensors["t3"]}  # a tensor of another shape is refused
        with pytest.raises(ValueError, match="t2 has shape"):
            parallel_files.write_streamed(
                tmp_path / "c.safetensors", shapes, *stored, wrong.get, pool
            )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors"]  # no temporary left


def test_an_interrupted_stream_writes_nothing_after_it_and_leaves_nothing(tmp_path):
    """Interrupted while its threads convert (^C, here while the pool starts a thread: the
    writer never gets that task's future), the writer closes its file and no thread writes
    after: not into the file that takes the closed descriptor's number next."""
    import signal
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    assert threading.current_thread() is threading.main_thread()  # where ^C is raised
    tensors = {f"t{i}": np.full((4, 4), i + 1, np.float32) for i in range(12)}
    shapes = {name: value.shape for name, value in tensors.items()}
    stored = ("float32", {"format": "pt"})
    started, made = [], []
    changed = threading.Condition()

    def slow(name):
        with changed:
            started.append(name)
        if name == "t0":
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        time.sleep(0.3)
        with changed:
            made.append(name)
            changed.notify_all()
        return tensors[name]

    # ^C as Python raises it by default (a test run before may have installed its own handler)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with ThreadPoolExecutor(3) as pool:
            with pytest.raises(KeyboardInterrupt):
                parallel_files.write_streamed(
                    tmp_path / "a.safetensors", shapes, *stored, slow, pool
                )
            fd = os.open(tmp_path / "next", os.O_RDWR | os.O_CREAT)  # the lowest free number
            # a thread whose start was interrupted is not the pool's to wait for: wait here
            with changed:
                assert changed.wait_for(lambda: len(made) == len(started), timeout=10)
    finally:
        signal.signal(signal.SIGINT, previous)
    os.close(fd)
    assert made and len(made) < len(tensors)  # the queued tasks were cancelled
    assert (tmp_path / "next").read_bytes() == b""
    assert [p.name for p in tmp_path.iterdir()] == ["next"]


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_an_npy_layout_is_what_numpy_save_writes(tmp_path, dtype):
    rng = np.random.default_rng(3)
    for shape in [(3, 5), (7,), (2, 3, 4), (1, 1)]:
        value = rng.standard_normal(shape).astype(DTYPES[dtype])
        np.save(tmp_path / "reference.npy", value, allow_pickle=False)
        expected = (tmp_path / "reference.npy").read_bytes()
        head, offsets, size = parallel_files.npy_layout(shape, dtype)
        assert size == len(expected) and offsets == {"": len(head)}
        assert expected == head + value.tobytes(), shape
