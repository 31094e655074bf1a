"""Generation on a quantized base (``model.decode``'s cached step, ``quantize.made_back_after``):
each layer's matrices made back as the layer runs, not the whole base before the first token
(docs/quantized-base.md, "what generation holds"), and the same tokens as generation on the
base made back outside the program (each matrix replaced by its BF16 ``dequantize``).

The memory is read from the compiled program's analysis: its temporaries against the bytes
of every layer's matrices made back in BF16. Compiles two generation loops (about 15 s each on
2 cores): slow tier."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from minifield.models import llama, model, quantize
from minifield.models import sampling as sampling_rules
from minifield.models.execution import Execution

pytestmark = pytest.mark.slow

SHAPE = dict(vocab_size=64, d_model=256, n_layers=6, n_heads=4, n_kv_heads=2, d_ff=512)
CFG = llama.LlamaConfig(**SHAPE, max_len=64, compute_dtype="bfloat16")
PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10]]
NEW = 24


def quantized_params(scheme: str):
    params = llama.init_params(CFG, jax.random.key(0))

    def held(path, x):
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        if not quantize.is_quantized(name, x.ndim):
            return x
        w = quantize.quantize(x.astype(jnp.float32) * 3.0, scheme, 64, double=True)
        return w.held_in("bfloat16")

    return jax.tree_util.tree_map_with_path(held, params)


def made_back(params):
    """Every quantized matrix replaced by the BF16 matrix ``dequantize`` makes of it."""
    return jax.tree.map(
        lambda leaf: (
            quantize.dequantize(leaf) if isinstance(leaf, quantize.QuantizedWeight) else leaf
        ),
        params,
        is_leaf=lambda leaf: isinstance(leaf, quantize.QuantizedWeight),
    )


def layer_matrix_bytes() -> int:
    """Every layer's matrices in BF16: q, o (D × D), k, v (D × D/2 here), 3 × D × F."""
    D, F = CFG.d_model, CFG.d_ff
    kv = CFG.n_kv_heads * (D // CFG.n_heads)
    return CFG.n_layers * 2 * (2 * D * D + 2 * D * kv + 3 * D * F)


def test_generation_makes_each_layer_back_as_it_runs_and_keeps_its_tokens():
    """The compiled loop's temporaries stay under half of every layer's matrices in BF16 (six
    layers: a layer's is a sixth); before ``made_back_after`` they held all of them and more
    (docs/quantized-base.md). Its greedy tokens are those of generation on the base made back
    outside the program. NF4 only: what ``made_back_after`` changes (the codes' dependence) is
    the same for int8 (:func:`test_made_back_after_keeps_every_code`)."""
    params = quantized_params("nf4")
    cfg = dataclasses.replace(CFG, execution=Execution(scan_layers=CFG.execution.scan_layers))
    buffer, lengths = model.prompt_buffer(PROMPTS, 32)  # the program generate_batch runs below
    compiled = model.decode.lower(
        params,
        cfg,
        jnp.asarray(buffer),
        jnp.asarray(lengths),
        jnp.asarray((-1,), jnp.int32),
        jnp.int32(NEW),
        sampling_rules.choice(None, jnp.uint32(0)),
        32,
    ).compile()
    temporaries = compiled.memory_analysis().temp_size_in_bytes
    assert temporaries < layer_matrix_bytes() / 2, (temporaries, layer_matrix_bytes())

    on_codes = model.greedy_generate_batch(params, CFG, PROMPTS, NEW, None, cache=True)
    reference = model.greedy_generate_batch(made_back(params), CFG, PROMPTS, NEW, None, cache=True)
    assert [len(row) for row in on_codes] == [NEW] * len(PROMPTS)
    assert on_codes == reference
    # the rows do not repeat one token throughout: a comparison that could tell them apart
    assert any(len(set(row)) > 3 for row in on_codes)
