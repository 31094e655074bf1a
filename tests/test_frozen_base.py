"""A LoRA run's frozen base held as its checkpoint stores it (:mod:`.stored_base`).

The base is ``test_base_model``'s, its tensors rounded to BF16 and written back with
``safetensors.numpy``. References independent of :mod:`.stored_base`: the tensors read back
with ``safetensors.numpy`` and widened and transposed by numpy through ``test_base_model``'s
hand-written name table; the FP32 loader (:func:`.checkpoint.load`, which widens and
transposes at load, as every LoRA run did before); and the same runs made side by side in
the test, on this machine, with the base held as every LoRA run held it before this change
(commit f1053f6: prepared as FP32 ``[in, out]`` arrays, cast on the host, a plain parameter
tree on the device): equal final state hashes, every state array and every exported file
byte for byte. Bits are compared only between two runs made here: XLA's CPU kernels follow
the processor, so bits recorded on one machine are not a property of the code.
"""

from __future__ import annotations

import hashlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from test_base_model import HF_TO_OURS, _prepare, _sha, make_inputs
from test_lora import ROWS, lora_recipe

from minifield.hf import checkpoint as hf_checkpoint
from minifield.hf import pinned_base
from minifield.hf.stored_base import FrozenBase
from minifield.models import model
from minifield.state.arrays import state_hash
from minifield.training import lora

# Documentation only, compared nowhere: the final state hash and the exported
# ``model.safetensors`` and ``adapter/adapter_model.safetensors`` of the two runs below were
# recorded once with the code before this change (commit f1053f6, jaxlib 0.10.2, CPU) as
#   FP32 base (test_lora's ``trained``)  6a758ec9…  2a03fab0…  c326297b…
#   BF16-rounded base (``bf16_run``)     ec7ac6b4…  88db075e…  a4fea96e…
# XLA's CPU kernels follow the processor's features, so those bits hold on the machine that
# recorded them and are not expected on another CPU even with the same lock; the tests
# compare the two code paths run side by side here instead (:func:`assert_the_run_before`).


def _bf16_inputs(root):
    """``test_base_model``'s inputs with the base's tensors rounded to BF16 (re-pinned)."""
    make_inputs(root)
    weights = root / "base" / "model.safetensors"
    tensors = load_file(str(weights))
    bf16 = {k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}
    save_file(bf16, str(weights), {"format": "pt"})
    recipe = lora_recipe(root)  # base_dtype float32: the step widens the BF16 base
    for entry in recipe["inputs"]:
        if entry["name"] == "base-weights":
            entry["sha256"] = _sha(weights)
    return recipe


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("frozen") / "in"
    recipe = _bf16_inputs(root)
    loaded, (arrays, _) = _prepare(recipe, root)
    program = loaded.strategy.build(loaded.data, arrays)
    return {"root": root, "loaded": loaded, "arrays": arrays, "program": program}


def _reference(root, dtype=np.float32) -> dict:
    """The base as :mod:`.llama` runs it, from the file by numpy: widened, transposed."""
    params: dict = {"blocks": {}}
    for name, value in load_file(str(root / "base" / "model.safetensors")).items():
        path, transpose = HF_TO_OURS[name]
        node = params
        *parents, leaf = path.split("/")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = jnp.asarray((value.T if transpose else value).astype(np.float32), dtype)
    return params


def test_a_bf16_base_stays_bf16_in_hf_layout_from_file_to_device(bf16_run):
    stored = load_file(str(bf16_run["root"] / "base" / "model.safetensors"))
    arrays, base = bf16_run["arrays"], bf16_run["program"]._base
    assert isinstance(base, FrozenBase) and base.dtype == "float32"
    for name, value in stored.items():
        path, transpose = HF_TO_OURS[name]
        # prepared: the file's bits, as stored (.npy has no BF16: its uint16 bits)
        prepared = np.asarray(arrays["base." + path.replace("/", ".")])
        assert prepared.dtype == np.uint16
        np.testing.assert_array_equal(prepared, value.view(np.uint16))
        # on the device: BF16, HF's [out, in] shape
        node = base.params
        for part in path.split("/"):
            node = node[part]
        assert node.dtype == jnp.bfloat16 and node.shape == value.shape
        assert (path in base.out_in) == transpose


def test_bf16_base_logits_equal_the_widened_loaders_exactly_in_fp32(bf16_run):
    program = bf16_run["program"]
    assert program.cfg.compute_dtype == "float32"
    cfg = program.cfg

    @jax.jit
    def logits(base, tokens, positions):  # the model's parameters made inside the jit
        params = base.model_params() if isinstance(base, FrozenBase) else base
        return model.forward(params, cfg, tokens, jnp.ones_like(tokens), positions)

    tokens = jnp.asarray(ROWS, jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    ours = np.asarray(logits(program._base, tokens, positions))
    # the FP32 loader widens and transposes on the host, as every LoRA run did before
    _, widened = hf_checkpoint.load(bf16_run["root"] / "base", 64, "float32")
    np.testing.assert_array_equal(ours, np.asarray(logits(widened, tokens, positions)))
    reference = _reference(bf16_run["root"])
    np.testing.assert_array_equal(ours, np.asarray(logits(reference, tokens, positions)))
    # full fine-tuning's masters: the same values, this project's layout, FP32
    masters = pinned_base.params_from_arrays(bf16_run["arrays"])
    for path, leaf in jax.tree_util.tree_leaves_with_path(widened):
        node = masters
        for key in path:
            node = node[key.key]
        assert node.dtype == np.float32
        np.testing.assert_array_equal(node, np.asarray(leaf))


@pytest.mark.slow  # two compiles; the fast tier keeps the BF16 base's logits test above
@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
def test_a_lora_step_on_the_hf_layout_equals_the_transposed_layout_bit_for_bit(
    bf16_run, compute_dtype
):
    """Loss and adapter gradients with the base contracted as stored ([out, in], the
    transpose folded into the products) and with numpy's transposed copies."""
    import dataclasses

    program = bf16_run["program"]
    cfg = dataclasses.replace(program.cfg, compute_dtype=compute_dtype)
    adapters = lora.init_adapters(cfg, program.lora, jax.random.key(1))
    # B nonzero, so the adapters' path carries the base's products into the gradients
    adapters = jax.tree_util.tree_map(lambda a: a + 0.01, adapters)
    batch = jax.tree_util.tree_map(jnp.asarray, program.batches.batch(0))

    def loss_and_grads(base):
        def loss(ad):
            return model.loss_fn(lora.adapted(base, ad, program.lora), cfg, batch)[0]

        return jax.value_and_grad(loss)(adapters)

    stored = jax.jit(loss_and_grads)(program._base)
    transposed = jax.jit(loss_and_grads)(_reference(bf16_run["root"]))
    leaves = jax.tree_util.tree_leaves(stored), jax.tree_util.tree_leaves(transposed)
    for a, b in zip(*leaves, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _trained_export(program, directory):
    state = program.place(program.init_state())
    for _ in range(3):
        state, _ = program.step(state)
    program.export(state, directory)
    return state


def _base_before_the_change(root, base_dtype: str) -> dict:
    """The frozen base as every LoRA run held it before this change: the FP32 loader's
    parameters (widened and transposed on the host: the arrays prepare wrote then) cast to
    ``base_dtype`` and put on the device as a plain parameter tree (``lora.frozen_base`` then)."""
    _, params = hf_checkpoint.load(root / "base", 64, "float32")
    dtype = jnp.bfloat16 if base_dtype == "bfloat16" else jnp.float32
    return jax.tree_util.tree_map(lambda a: jnp.asarray(np.asarray(a, np.float32), dtype), params)


def _sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _files(directory) -> dict:
    return {
        str(p.relative_to(directory)): p.read_bytes() for p in directory.rglob("*") if p.is_file()
    }


def assert_the_run_before(loaded, program, root, state, export, tmp_path) -> None:
    """``state`` and ``export`` (three in-process updates of ``program``, the base held as
    stored) equal, bit for bit, the same run made here, on this machine, by a second program
    of the same recipe and prepared arrays with the base held as before this change: the
    final state hash, every state array, every exported file."""
    now = program._base
    twin = loaded.strategy.build(loaded.data, program.arrays)
    twin._base = _base_before_the_change(root, program.lora.base_dtype)
    # the two paths really differ: stored [out, in] in the file's dtype against FP32 [in, out]
    assert isinstance(now, FrozenBase) and now.out_in
    assert not isinstance(twin._base, FrozenBase)
    for path in now.out_in:
        stored, held = now.params, twin._base
        for part in path.split("/"):
            stored, held = stored[part], held[part]
        assert held.shape == stored.shape[::-1] and held.dtype == jnp.dtype(now.dtype)
    reference = _trained_export(twin, tmp_path / "before")
    assert state_hash(state) == state_hash(reference)
    leaves = jax.tree_util.tree_leaves_with_path(state), jax.tree_util.tree_leaves(reference)
    for (path, a), b in zip(*leaves, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(path))
    for file in ("model.safetensors", "adapter/adapter_model.safetensors"):
        assert _sha256(export / file) == _sha256(tmp_path / "before" / file), file
    ours, theirs = _files(export), _files(tmp_path / "before")
    assert sorted(ours) == sorted(theirs)
    for name, data in ours.items():
        assert data == theirs[name], name


@pytest.mark.slow  # 3.6 s under 3.12 since its exports are merged on the host tensor by tensor
def test_a_bf16_base_lora_run_and_its_exports_are_those_before_the_change(bf16_run, tmp_path):
    """The run with the BF16 base held as stored against the same run, made here, with the
    base held as before (widened and transposed on the host): no bit of the run changed."""
    loaded, program, root = bf16_run["loaded"], bf16_run["program"], bf16_run["root"]
    state = _trained_export(program, tmp_path / "export")
    assert_the_run_before(loaded, program, root, state, tmp_path / "export", tmp_path)


@pytest.mark.slow  # a compile; the fast tier's time is at its limit under Python 3.12
def test_the_compiled_update_reports_its_memory_from_its_arguments(bf16_run):
    """The ``compiled`` event's ``memory``: its arguments are the state, the frozen base and
    the batch the update is compiled for, counted here leaf by leaf; the donated state is
    aliased to the new state at most (never more than it holds)."""
    program = bf16_run["program"]
    program.compile()

    def nbytes(tree) -> int:
        leaves = jax.tree_util.tree_leaves(tree)
        return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in leaves)

    state = nbytes(jax.eval_shape(program.start.abstract))
    base, batch = nbytes(program._base), nbytes(program.abstract_batch())
    memory = program.memory
    assert memory["arguments"] == state + base + batch
    assert 0 < memory["aliased"] <= state
    assert memory["peak"] == (
        memory["arguments"] + memory["outputs"] + memory["temporaries"] - memory["aliased"]
    )
