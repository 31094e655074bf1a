"""A minimal JAX+optax training loop of the Llama model, the baseline our step is measured against.

The same model as ``LlamaConfig`` (RMSNorm, rotary, grouped-query attention by repeating
key/value heads, segment-restricted causal softmax, SwiGLU, untied head, cross-entropy on the
counted targets) written from the equations as one params dict, one loss,
``optax.chain(clip_by_global_norm, adamw(warmup+cosine))`` and ``jax.jit`` with donation. In
BF16 mode every product is BF16 x BF16 with FP32 accumulation in forward and backward (its own
custom VJP), as ours. Attention is either the dense XLA form (``[B, H, T, T]`` scores under a
mask) or the fused Pallas kernel called directly (``mha(segment_ids=…, causal=True)``, its
default tiling; Pallas's interpreter on CPU).

Used by ``llama_step.py`` (CPU, d512), ``device_check`` (125M / 350M on a device) and, its
:func:`logits` under a GRPO loss, ``grpo_update.py``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.ad_checkpoint import checkpoint_name

from minifield.data.packing import Rows
from minifield.training import optimizer as project_optimizer

F32, BF16 = jnp.float32, jnp.bfloat16


@dataclass(frozen=True)
class Shape:
    """The model's dimensions (what ``LlamaConfig`` says with the same names)."""

    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    vocab_size: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


def packed_batch(B: int, T: int, vocab: int, seed: int = 0) -> Rows:
    """Rows of several segments (16..T/2 tokens), positions restarting per segment, loss on
    the second half of each segment, a little padding at the end of a row."""
    rng = np.random.default_rng(seed)
    batch = Rows(*(np.zeros((B, T), np.int32) for _ in "tsp"), np.zeros((B, T), np.float32))
    batch.tokens[:] = rng.integers(0, vocab, (B, T))
    shortest = min(16, T // 4)
    for r in range(B):
        at, seg = 0, 1
        while at < T - shortest - 4:
            n = int(min(rng.integers(shortest, max(T // 2, shortest + 1)), T - 4 - at))
            batch.segments[r, at : at + n] = seg
            batch.positions[r, at : at + n] = np.arange(n)
            batch.loss_mask[r, at + n // 2 : at + n] = 1.0
            at, seg = at + n, seg + 1
    return jax.tree_util.tree_map(jnp.asarray, batch)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def bf16_dot(eq, a, b):
    """BF16 x BF16 -> FP32 einsum whose backward products are BF16 x BF16 -> FP32 too."""
    return jnp.einsum(eq, a.astype(BF16), b.astype(BF16), preferred_element_type=F32)


def _bf16_dot_fwd(eq, a, b):
    # the operands' dtypes ride along as zero-size arrays (residuals must be arrays)
    protos = (jnp.zeros((0,), a.dtype), jnp.zeros((0,), b.dtype))
    a16, b16 = a.astype(BF16), b.astype(BF16)
    # the einsum itself, not bf16_dot again: a remat policy sees (and dots_saveable keeps)
    # only a product it can see, and a nested custom_vjp hides it
    return jnp.einsum(eq, a16, b16, preferred_element_type=F32), (a16, b16, *protos)


def _bf16_dot_bwd(eq, res, g):
    a, b, a_proto, b_proto = res
    ins, out = eq.split("->")
    sa, sb = ins.split(",")
    g = g.astype(BF16)
    da = jnp.einsum(f"{out},{sb}->{sa}", g, b, preferred_element_type=F32)
    db = jnp.einsum(f"{sa},{out}->{sb}", a, g, preferred_element_type=F32)
    return da.astype(a_proto.dtype), db.astype(b_proto.dtype)


bf16_dot.defvjp(_bf16_dot_fwd, _bf16_dot_bwd)


def init(shape: Shape, key) -> dict:
    D, F, V, K = shape.d_model, shape.d_ff, shape.vocab_size, shape.head_dim
    H, G = shape.n_heads, shape.n_kv_heads
    keys = iter(jax.random.split(key, 4 + 7 * shape.n_layers))

    def normal(dims, scale):
        return jax.random.normal(next(keys), dims, F32) * scale

    layers = [
        {
            "ln1": jnp.ones(D),
            "ln2": jnp.ones(D),
            "wq": normal((D, H * K), D**-0.5),
            "wk": normal((D, G * K), D**-0.5),
            "wv": normal((D, G * K), D**-0.5),
            "wo": normal((H * K, D), D**-0.5),
            "wg": normal((D, F), D**-0.5),
            "wu": normal((D, F), D**-0.5),
            "wd": normal((F, D), F**-0.5),
        }
        for _ in range(shape.n_layers)
    ]
    return {
        "emb": normal((V, D), 0.02),
        "layers": layers,
        "norm": jnp.ones(D),
        "head": normal((D, V), D**-0.5),
    }


def _dense_attention(dot, compute, q, k, v, seg):
    B, T, H, K = q.shape
    causal = jnp.tril(jnp.ones((T, T), bool))
    mask = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] != 0) & causal  # [B, T, T]
    q, k, v = (t.transpose(0, 2, 1, 3).reshape(B * H, T, K) for t in (q, k, v))
    s = dot("ntk,nsk->nts", q, k).reshape(B, H, T, T) * K**-0.5
    s = jnp.where(mask[:, None], s, jnp.finfo(F32).min)
    a = jax.nn.softmax(s, -1).astype(compute).reshape(B * H, T, T)
    o = dot("nts,nsk->ntk", a, v).astype(compute)
    return o.reshape(B, H, T, K).transpose(0, 2, 1, 3)


@functools.lru_cache(maxsize=8)
def _splash_kernel(T: int, H: int, K: int):
    """Splash's MHA kernel, causal, over ``H`` heads of rows of ``T``, with the blocks ours
    runs at this shape (``splash_table.splash_blocks``): the same kernel and blocks, compared."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    from minifield.models.splash_table import splash_blocks

    with jax.ensure_compile_time_eval():  # its mask tables: concrete, made once per shape
        return splash.make_splash_mha_single_device(
            splash.MultiHeadMask([splash.CausalMask((T, T))] * H),
            block_sizes=splash.BlockSizes(**splash_blocks(T, head_dim=K)),
        )


def _splash_attention(compute, q, k, v, seg):
    """Splash attention on a TPU: the queries scaled first (it computes plain q k^T), every
    head's keys and values (repeated, as the dense path has them), a row at a time."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    B, T, H, K = q.shape
    kernel = _splash_kernel(T, H, K)
    q = (q.astype(F32) * K**-0.5).astype(compute)
    heads = [t.astype(compute).transpose(0, 2, 1, 3) for t in (q, k, v)]  # [B, H, T, K]

    def row(q_HxTxK, k_HxTxK, v_HxTxK, seg_T):
        return kernel(q_HxTxK, k_HxTxK, v_HxTxK, segment_ids=splash.SegmentIds(seg_T, seg_T))

    return jax.vmap(row)(*heads, seg).transpose(0, 2, 1, 3).astype(compute)


def _fused_attention(compute, q, k, v, seg):
    if jax.default_backend() == "tpu":
        return _splash_attention(compute, q, k, v, seg)
    from jax.experimental.pallas.ops.gpu import attention as pallas_attention

    K = q.shape[-1]
    return pallas_attention.mha(
        q.astype(compute),
        k.astype(compute),
        v.astype(compute),
        seg,
        sm_scale=K**-0.5,
        causal=True,
        interpret=jax.default_backend() == "cpu",
    ).astype(compute)


#: this module's MLP weights and minifield's names for them
MLP_NAMES = {"wg": "w_gate", "wu": "w_up", "wd": "w_down"}


def dense_mlp(block: dict) -> dict:
    """A minifield block's dense MLP weights (copies) in this module's names."""
    return {k: jnp.array(block["mlp"][name]) for k, name in MLP_NAMES.items()}


def from_minifield(params: dict, mlp=dense_mlp) -> dict:
    """minifield's parameters (copies) in this module's tree; ``mlp(block)`` gives a block's
    MLP entries (a dense MLP's by default)."""
    copy = jnp.array
    return {
        "emb": copy(params["embed"]["tokens"]),
        "layers": [
            {
                "ln1": copy(b["attn_norm"]["scale"]),
                "ln2": copy(b["mlp_norm"]["scale"]),
                **{k: copy(b["attn"][k]) for k in ("wq", "wk", "wv", "wo")},
                **mlp(b),
            }
            for _, b in sorted(params["blocks"].items())
        ],
        "norm": copy(params["final_norm"]["scale"]),
        "head": copy(params["head"]["w"]),
    }


def swiglu(p, x, dot, compute):
    """The dense MLP ``wd(silu(wg x) * wu x)``, FP32 (each product through ``dot``)."""
    g = dot("btd,df->btf", x, p["wg"])
    u = dot("btd,df->btf", x, p["wu"])
    return dot("btf,fd->btd", (jax.nn.silu(g) * u).astype(compute), p["wd"])


def logits(
    params, batch, shape: Shape, compute, attention: str = "xla", mlp=swiglu, remat: str = "none"
):
    """FP32 logits ``[B, T, V]`` of every slot of a packed batch; ``mlp(p, x, dot, compute)``:
    each layer's MLP on its normed input (``moe_update.py`` passes mixtures of experts).
    ``remat`` as ``training.remat``: ``full`` keeps each layer's input alone for the backward
    pass, ``dots_saveable`` its products too (what ours does on a TPU, where the scores of
    every layer kept at once do not fit), ``save_attention`` the attention's rotated q, k, v
    and output by name (:func:`remat_policy`), ``offload_attention`` those in host memory."""
    dot = (lambda eq, a, b: bf16_dot(eq, a, b)) if compute == BF16 else jnp.einsum
    tokens, seg, pos = batch.tokens, batch.segments, batch.positions
    B, T = tokens.shape
    H, G, K = shape.n_heads, shape.n_kv_heads, shape.head_dim

    def rms(x, scale):
        x = x.astype(F32)
        x = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + shape.norm_eps) * scale
        return x.astype(compute)

    inv = shape.rope_theta ** (-jnp.arange(0, K, 2, dtype=F32) / K)
    angle = pos[..., None].astype(F32) * inv  # [B, T, K/2]
    cos, sin = jnp.cos(angle)[:, :, None], jnp.sin(angle)[:, :, None]

    def rope(x):
        x1, x2 = x[..., : K // 2].astype(F32), x[..., K // 2 :].astype(F32)
        return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(compute)

    def layer(h, p):
        x = rms(h, p["ln1"])
        q = rope(dot("btd,dn->btn", x, p["wq"]).astype(compute).reshape(B, T, H, K))
        k = rope(dot("btd,dn->btn", x, p["wk"]).astype(compute).reshape(B, T, G, K))
        v = dot("btd,dn->btn", x, p["wv"]).astype(compute).reshape(B, T, G, K)
        q, k, v = (checkpoint_name(t, "attention_inputs") for t in (q, k, v))
        k, v = jnp.repeat(k, H // G, axis=2), jnp.repeat(v, H // G, axis=2)
        if attention == "pallas":
            o = _fused_attention(compute, q, k, v, seg)
        else:
            o = _dense_attention(dot, compute, q, k, v, seg)
        o = checkpoint_name(o, "attention_output")
        h = h + dot("btn,nd->btd", o.reshape(B, T, H * K), p["wo"]).astype(compute)
        return h + mlp(p, rms(h, p["ln2"]), dot, compute).astype(compute)

    if remat != "none":
        layer = jax.checkpoint(layer, policy=remat_policy(remat))
    h = params["emb"][tokens].astype(compute)
    for p in params["layers"]:
        h = layer(h, p)
    return dot("btd,dv->btv", rms(h, params["norm"]), params["head"])


def remat_policy(remat: str):
    """``jax.checkpoint``'s policy for a ``training.remat`` value (``full``: None, keep only
    the layer's input)."""
    names = ["attention_inputs", "attention_output"]
    policies = jax.checkpoint_policies
    return {
        "full": None,
        "dots_saveable": policies.dots_saveable,
        "save_attention": policies.save_only_these_names(*names),
        "offload_attention": policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[],
            names_which_can_be_offloaded=names,
            offload_src="device",
            offload_dst="pinned_host",
        ),
    }[remat]


def _weight(batch):
    """1 where a position's next token is a counted target (same segment, not padding, in
    the loss mask), else 0."""
    seg = batch.segments
    counted = (seg[:, :-1] == seg[:, 1:]) & (seg[:, :-1] != 0)
    return jnp.pad(jnp.where(counted, batch.loss_mask[:, 1:], 0.0), ((0, 0), (0, 1)))


def loss_sum(
    params, batch, shape: Shape, compute, attention: str = "xla", mlp=swiglu, remat: str = "none"
):
    """The summed negative log-likelihood of the counted targets."""
    logits_ = logits(params, batch, shape, compute, attention, mlp, remat)
    targets = jnp.pad(batch.tokens[:, 1:], ((0, 0), (0, 1)))
    logp = jax.nn.log_softmax(logits_, -1)
    nll = -jnp.take_along_axis(logp, targets[..., None], -1)[..., 0]
    return jnp.sum(nll * _weight(batch))


def loss(
    params, batch, shape: Shape, compute, attention: str = "xla", mlp=swiglu, remat: str = "none"
):
    total = loss_sum(params, batch, shape, compute, attention, mlp, remat)
    return total / jnp.maximum(jnp.sum(_weight(batch)), 1.0)


def make_optimizer(max_steps: int):
    """``optax.chain(clip_by_global_norm, adamw(warmup + cosine))`` with the project's default
    settings (the recipe schema's, ``optimizer.defaults()``), weight decay on matrices."""
    defaults = project_optimizer.defaults()
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, defaults["learning_rate"], defaults["warmup_steps"], max_steps
    )
    return optax.chain(
        optax.clip_by_global_norm(defaults["grad_clip_norm"]),
        optax.adamw(
            schedule,
            b1=defaults["b1"],
            b2=defaults["b2"],
            eps=defaults["eps"],
            weight_decay=defaults["weight_decay"],
            mask=lambda params: jax.tree_util.tree_map(lambda x: x.ndim >= 2, params),
        ),
    )


def accumulated(params, batch, shape: Shape, compute, attention, remat, accum: int):
    """``(loss, grads)`` of the batch's token mean, over ``accum`` micro-batches of its rows
    (a scan summing each one's gradient of its summed loss), divided by the batch's count."""
    if accum == 1:
        return jax.value_and_grad(loss)(params, batch, shape, compute, attention, remat=remat)
    count = jnp.maximum(jnp.sum(_weight(batch)), 1.0)
    micro = jax.tree.map(lambda a: a.reshape(accum, -1, *a.shape[1:]), batch)

    def one(summed, part):
        total, grads = jax.value_and_grad(loss_sum)(
            params, type(batch)(*part), shape, compute, attention, remat=remat
        )
        return jax.tree.map(jnp.add, summed, grads), total

    grads, totals = jax.lax.scan(one, jax.tree.map(jnp.zeros_like, params), tuple(micro))
    return jnp.sum(totals) / count, jax.tree.map(lambda g: g / count, grads)


def step_function(
    shape: Shape, compute, max_steps: int, attention: str = "xla", remat: str = "none",
    accum: int = 1,
):  # fmt: skip
    """``(step, optimizer)``: the plain ``step(params, opt_state, batch) -> (params,
    opt_state, loss)`` (not compiled) and :func:`make_optimizer`'s optimizer; ``remat`` as
    :func:`logits`'; ``accum`` micro-batches of the rows per update (:func:`accumulated`)."""
    optimizer = make_optimizer(max_steps)

    def step(params, opt_state, batch):
        value, grads = accumulated(params, batch, shape, compute, attention, remat, accum)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return step, optimizer


def make_step(
    shape: Shape, compute, max_steps: int, attention: str = "xla", remat: str = "none",
    accum: int = 1,
):  # fmt: skip
    """``(step, params, opt_state)``: :func:`step_function`'s step jit-compiled with params
    and optimizer state donated, and a fresh state."""
    step, optimizer = step_function(shape, compute, max_steps, attention, remat, accum)
    params = jax.jit(init, static_argnums=0)(shape, jax.random.key(0))
    return jax.jit(step, donate_argnums=(0, 1)), params, optimizer.init(params)
