"""The Llama-style model families an HF checkpoint may be: per family its HF class, what its
``config.json`` means for the architecture, and the one table of its tensor names.

A family is chosen by ``model_type`` (:mod:`minifield.hf.config` reads the fields). What differs:

==========  ====================  =========  =======  ===============  =========================
model_type  class                 qkv bias   q/k norm absent head_dim  sliding window
==========  ====================  =========  =======  ===============  =========================
llama       LlamaForCausalLM      no         no       hidden / heads   none
mistral     MistralForCausalLM    no         no       hidden / heads   every layer
qwen2       Qwen2ForCausalLM      yes        no       hidden / heads   ``use_sliding_window``
qwen3       Qwen3ForCausalLM      no         yes      128              ``use_sliding_window``
phi3        Phi3ForCausalLM       no         no       hidden / heads   every layer
gemma       GemmaForCausalLM      no         no       256              none
gemma2      Gemma2ForCausalLM     no         no       256              every other layer
gemma3_text Gemma3ForCausalLM     no         yes      256              5 of every 6 layers
mixtral     MixtralForCausalLM    no         no       hidden / heads   every layer
qwen2_moe   Qwen2MoeForCausalLM   yes        no       hidden / heads   refused
qwen3_moe   Qwen3MoeForCausalLM   no         yes      hidden / heads   refused
olmoe       OlmoeForCausalLM      no         whole    hidden / heads   none
==========  ====================  =========  =======  ===============  =========================

Qwen2-MoE, Qwen3-MoE and OLMoE (:mod:`.moe`) name the router ``mlp.gate`` and the experts
``mlp.experts.{j}.gate_proj`` / ``up_proj`` / ``down_proj`` (``moe_names`` "mlp");
Qwen2-MoE adds a shared expert ``mlp.shared_expert.*`` gated by ``mlp.shared_expert_gate``
``[1, hidden]`` (internally ``blocks/NN/moe/shared/{w_gate, w_up, w_down}`` and
``blocks/NN/moe/shared_gate`` ``[D, 1]``). Qwen's layers listed in ``mlp_only_layers``, or
not a multiple of ``decoder_sparse_step``, keep the dense ``mlp.*_proj`` of
``intermediate_size`` (``dense_layers``). OLMoE's q/k norms ("whole") are over the whole
projected queries and keys, not per head.

Mixtral (a mixture of experts, :mod:`.moe`): Mistral's attention, and in place of the MLP a
router ``block_sparse_moe.gate`` ``[num_local_experts, hidden]`` and per expert ``j``
``block_sparse_moe.experts.{j}.w1`` (gate), ``w3`` (up), ``w2`` (down), each token through
its ``num_experts_per_tok`` experts. Internally ``blocks/NN/moe/router`` and the experts
held stacked, ``blocks/NN/moe/experts/{w_gate, w_up, w_down}`` ``[E, in, out]``: the table
names expert ``j``'s matrix ``blocks/NN/moe/experts/JJ/w_gate`` (an *expert slot*, one HF
tensor), which is the ``j``-th of the stacked parameter (:mod:`.expert_slots`); loading
stacks the experts' tensors, exporting slices them again.

Gemma (v1): RMSNorm times ``1 + w``, embeddings times ``sqrt(hidden_size)``, the MLP gate
``hidden_act`` (``gelu_pytorch_tanh``, absent too, or ``gelu``), the head tied unless
``tie_word_embeddings`` is false. Gemma 2 adds: a norm after attention and after the MLP
(four per layer: ``post_attention_layernorm`` is then the attention output's norm,
``pre_feedforward_layernorm`` the MLP input's), the gate ``hidden_activation``, scores scaled
by ``query_pre_attn_scalar ** -0.5`` (absent: 256) and soft-capped
(``attn_logit_softcapping``, absent: 50), logits soft-capped (``final_logit_softcapping``,
absent: 30), ``sliding_window`` (absent: 4096) on the layers ``layer_types`` marks, absent:
layers 0, 2, 4, ... Gemma 3 (text): Gemma 2 without soft-capping by default, with q/k norms
(``1 + w``), the window on all but every ``sliding_window_pattern``-th layer (absent: 6), and
the sliding layers' rotary base ``rope_local_base_freq`` (absent: 10000; no ``rope_scaling``
there), the others' ``rope_theta`` (absent: 1e6) with ``rope_scaling``.

Phi-3 stores q/k/v as one ``qkv_proj`` matrix (rows: queries, keys, values) and the MLP's gate
and up as one ``gate_up_proj`` (rows: gate, then up): :data:`NAME_TABLE` maps each to a tuple
of parameters, split on load and joined again on export (:func:`split`, :func:`join`).

``use_sliding_window`` (Qwen): the window applies to the layers ``layer_types`` marks
``sliding_attention``; without ``layer_types``, to layers ``i >= max_window_layers`` (absent:
28), as transformers' Qwen configs compute it.

:data:`NAME_TABLE` maps HF (PyTorch) tensor names to this project's parameter paths (see
:mod:`.llama`). ``transpose`` marks a ``torch.nn.Linear`` weight, which PyTorch stores
``[out, in]`` and :mod:`.llama` holds ``[in, out]``. This module does not import JAX, nor
:mod:`.llama_config` (which reads its layer types): ``cfg`` is a
:class:`~.llama_config.LlamaConfig`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .expert_slots import expert_slot


@dataclass(frozen=True)
class Family:
    """What one ``model_type`` means (see the module's table)."""

    model_type: str
    architecture: str
    qkv_bias: bool = False
    qk_norm: bool = False
    #: ``head_dim`` when config.json has none (None: hidden_size / num_attention_heads)
    default_head_dim: int | None = None
    #: how ``sliding_window`` is read: "" (refused when it binds), "all" (every layer),
    #: "qwen" (only with ``use_sliding_window``, on the layers ``layer_types`` names),
    #: "gemma2" (always, on ``layer_types``'s layers, absent: every other layer from the first),
    #: "gemma3" (likewise, absent: all but every ``sliding_window_pattern``-th layer)
    sliding: str = ""
    #: Gemma's ways: ``(1 + w)`` RMSNorm, embeddings times sqrt(hidden_size), GELU gate
    #: (``hidden_act``, absent: the tanh approximation), tied head when the field is absent
    gemma: bool = False
    #: ``rope_theta`` when config.json has none
    default_rope_theta: float = 10000.0
    #: q/k/v and gate/up stored as one matrix each (Phi-3's ``qkv_proj``, ``gate_up_proj``)
    fused_projections: bool = False
    #: whether ``attention_bias`` true is refused (it would add an o_proj bias; Qwen2's
    #: q/k/v biases are the family's own, it has no such field)
    attention_bias_field: bool = True
    #: a mixture of experts in place of the MLP (Mixtral's ``block_sparse_moe``, Qwen-MoE's
    #: and OLMoE's ``mlp``)
    moe: bool = False


FAMILIES = {
    f.model_type: f
    for f in (
        Family("llama", "LlamaForCausalLM"),
        Family("mistral", "MistralForCausalLM", sliding="all"),
        Family(
            "qwen2", "Qwen2ForCausalLM", qkv_bias=True, sliding="qwen", attention_bias_field=False
        ),
        Family("qwen3", "Qwen3ForCausalLM", qk_norm=True, default_head_dim=128, sliding="qwen"),
        Family("phi3", "Phi3ForCausalLM", sliding="all", fused_projections=True),
        Family("gemma", "GemmaForCausalLM", default_head_dim=256, gemma=True),
        Family("gemma2", "Gemma2ForCausalLM", default_head_dim=256, gemma=True, sliding="gemma2"),
        Family(
            "gemma3_text",
            "Gemma3ForCausalLM",
            qk_norm=True,
            default_head_dim=256,
            gemma=True,
            sliding="gemma3",
            default_rope_theta=1_000_000.0,
        ),
        Family(
            "mixtral",
            "MixtralForCausalLM",
            sliding="all",
            default_rope_theta=1_000_000.0,
            moe=True,
        ),
        Family(
            "qwen2_moe",
            "Qwen2MoeForCausalLM",
            qkv_bias=True,
            attention_bias_field=False,
            moe=True,
        ),
        Family("qwen3_moe", "Qwen3MoeForCausalLM", qk_norm=True, moe=True),
        Family("olmoe", "OlmoeForCausalLM", qk_norm=True, moe=True),
    )
}
#: HF ``architectures`` entry -> ``model_type``
ARCHITECTURES = {f.architecture: f.model_type for f in FAMILIES.values()}
#: ``layer_types`` values: a layer with the window, and one attending to its whole segment
SLIDING, FULL = "sliding_attention", "full_attention"
#: transformers' Qwen2/Qwen3 ``max_window_layers`` when config.json has none
QWEN_MAX_WINDOW_LAYERS = 28


def family_of(cfg) -> Family:
    """The family an export of ``cfg`` without a base model's ``config.json`` is written as:
    the simplest one that holds every feature it has."""
    if cfg.n_experts:
        if cfg.qk_norm_whole:
            return FAMILIES["olmoe"]
        if cfg.qk_norm:
            return FAMILIES["qwen3_moe"]
        if cfg.shared_expert_d_ff:
            return FAMILIES["qwen2_moe"]
        return FAMILIES["mixtral"]
    if cfg.fused_projections:
        return FAMILIES["phi3"]
    if cfg.sandwich_norms:
        return FAMILIES["gemma3_text" if cfg.qk_norm else "gemma2"]
    if cfg.norm_plus_one:
        return FAMILIES["gemma"]
    if cfg.qk_norm:
        return FAMILIES["qwen3"]
    if cfg.qkv_bias:
        return FAMILIES["qwen2"]
    if cfg.sliding_window is not None and not cfg.layer_types:
        return FAMILIES["mistral"]
    return FAMILIES["llama"]


_QKV = ("blocks/{i}/attn/wq", "blocks/{i}/attn/wk", "blocks/{i}/attn/wv")
_GATE_UP = ("blocks/{i}/mlp/w_gate", "blocks/{i}/mlp/w_up")
#: the parameters a fused matrix holds (stored as separate matrices otherwise)
_FUSED_PARTS = {"/".join(p.rsplit("/", 2)[-2:]) for p in _QKV + _GATE_UP}

#: Gemma 2's norm of the attention output: the HF name post_attention_layernorm means the MLP
#: input's norm in every other family (Gemma 2 calls that one pre_feedforward_layernorm)
_ATTN_POST = "blocks/{i}/attn_post_norm/scale"
_SANDWICH = ("pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight")

# HF name ({i}: layer index)                   internal path ({i}: 2-digit layer)   transpose
NAME_TABLE = [
    ("model.embed_tokens.weight",                        "embed/tokens",              False),
    ("model.layers.{i}.input_layernorm.weight",          "blocks/{i}/attn_norm/scale", False),
    ("model.layers.{i}.self_attn.q_proj.weight",         "blocks/{i}/attn/wq",        True),
    ("model.layers.{i}.self_attn.k_proj.weight",         "blocks/{i}/attn/wk",        True),
    ("model.layers.{i}.self_attn.v_proj.weight",         "blocks/{i}/attn/wv",        True),
    ("model.layers.{i}.self_attn.q_proj.bias",           "blocks/{i}/attn/bq",        False),  # qkv_bias
    ("model.layers.{i}.self_attn.k_proj.bias",           "blocks/{i}/attn/bk",        False),  # qkv_bias
    ("model.layers.{i}.self_attn.v_proj.bias",           "blocks/{i}/attn/bv",        False),  # qkv_bias
    ("model.layers.{i}.self_attn.q_norm.weight",         "blocks/{i}/attn/q_norm",    False),  # qk_norm
    ("model.layers.{i}.self_attn.k_norm.weight",         "blocks/{i}/attn/k_norm",    False),  # qk_norm
    ("model.layers.{i}.self_attn.qkv_proj.weight",       _QKV,                        True),  # fused
    ("model.layers.{i}.self_attn.o_proj.weight",         "blocks/{i}/attn/wo",        True),
    ("model.layers.{i}.post_attention_layernorm.weight", "blocks/{i}/mlp_norm/scale", False),  # not Gemma 2
    ("model.layers.{i}.post_attention_layernorm.weight", _ATTN_POST,                  False),  # Gemma 2
    ("model.layers.{i}.pre_feedforward_layernorm.weight", "blocks/{i}/mlp_norm/scale", False),  # Gemma 2
    ("model.layers.{i}.post_feedforward_layernorm.weight", "blocks/{i}/mlp_post_norm/scale", False),  # Gemma 2
    ("model.layers.{i}.mlp.gate_proj.weight",            "blocks/{i}/mlp/w_gate",     True),
    ("model.layers.{i}.mlp.up_proj.weight",              "blocks/{i}/mlp/w_up",       True),
    ("model.layers.{i}.mlp.gate_up_proj.weight",         _GATE_UP,                    True),  # fused
    ("model.layers.{i}.mlp.down_proj.weight",            "blocks/{i}/mlp/w_down",     True),
    ("model.layers.{i}.block_sparse_moe.gate.weight",    "blocks/{i}/moe/router",     True),  # moe
    ("model.layers.{i}.block_sparse_moe.experts.{j}.w1.weight", "blocks/{i}/moe/experts/{j}/w_gate", True),  # moe
    ("model.layers.{i}.block_sparse_moe.experts.{j}.w3.weight", "blocks/{i}/moe/experts/{j}/w_up", True),  # moe
    ("model.layers.{i}.block_sparse_moe.experts.{j}.w2.weight", "blocks/{i}/moe/experts/{j}/w_down", True),  # moe
    ("model.layers.{i}.mlp.gate.weight",                 "blocks/{i}/moe/router",     True),  # moe, mlp names
    ("model.layers.{i}.mlp.experts.{j}.gate_proj.weight", "blocks/{i}/moe/experts/{j}/w_gate", True),  # moe, mlp names
    ("model.layers.{i}.mlp.experts.{j}.up_proj.weight",  "blocks/{i}/moe/experts/{j}/w_up", True),  # moe, mlp names
    ("model.layers.{i}.mlp.experts.{j}.down_proj.weight", "blocks/{i}/moe/experts/{j}/w_down", True),  # moe, mlp names
    ("model.layers.{i}.mlp.shared_expert.gate_proj.weight", "blocks/{i}/moe/shared/w_gate", True),  # shared expert
    ("model.layers.{i}.mlp.shared_expert.up_proj.weight", "blocks/{i}/moe/shared/w_up", True),  # shared expert
    ("model.layers.{i}.mlp.shared_expert.down_proj.weight", "blocks/{i}/moe/shared/w_down", True),  # shared expert
    ("model.layers.{i}.mlp.shared_expert_gate.weight",   "blocks/{i}/moe/shared_gate", True),  # shared expert
    ("model.norm.weight",                                "final_norm/scale",          False),
    ("lm_head.weight",                                   "head/w",                    True),  # untied
]  # fmt: skip


def param_shape(cfg, path: str) -> tuple[int, ...]:
    """Shape of an internal parameter (the layout :func:`.llama.init_params` makes; an
    expert slot's: one expert's matrix, the stacked parameter's ``[E, in, out]``)."""
    slot = expert_slot(path)
    if slot is not None:
        return param_shape(cfg, slot[0])[1:]
    D, F, V, K = cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.head_dim
    HK, GK = cfg.n_heads * K, cfg.n_kv_heads * K
    leaf = path.rsplit("/", 2)
    kind = "/".join(leaf[-2:])
    if cfg.qk_norm_whole and kind in ("attn/q_norm", "attn/k_norm"):  # OLMoE's
        return (HK,) if kind == "attn/q_norm" else (GK,)
    if "/moe/" in path:  # the router [D, E], the shared gate [D, 1], experts as the MLP's
        if path.endswith(("/router", "/shared_gate")):
            return (D, cfg.n_experts if path.endswith("/router") else 1)
        F = cfg.shared_expert_d_ff if "/moe/shared/" in path else cfg.expert_d_ff
        kind = "mlp/" + leaf[-1]
    stack = (cfg.n_experts,) if "/moe/experts/" in path else ()  # the experts stacked
    shapes = {
        "moe/router": (D, cfg.n_experts),
        "embed/tokens": (V, D),
        "attn_norm/scale": (D,),
        "attn_post_norm/scale": (D,),
        "mlp_post_norm/scale": (D,),
        "mlp_norm/scale": (D,),
        "final_norm/scale": (D,),
        "attn/wq": (D, HK),
        "attn/wk": (D, GK),
        "attn/wv": (D, GK),
        "attn/bq": (HK,),
        "attn/bk": (GK,),
        "attn/bv": (GK,),
        "attn/q_norm": (K,),
        "attn/k_norm": (K,),
        "attn/wo": (HK, D),
        "mlp/w_gate": (D, F),
        "mlp/w_up": (D, F),
        "mlp/w_down": (F, D),
        "head/w": (D, V),
    }
    return stack + shapes[kind]


#: parameter kind -> the config.json fields its shape comes from (named when it disagrees)
_SHAPE_FIELDS = {
    "embed/tokens": "vocab_size, hidden_size",
    "attn/wq": "hidden_size, num_attention_heads x head_dim",
    "attn/wk": "hidden_size, num_key_value_heads x head_dim",
    "attn/wv": "hidden_size, num_key_value_heads x head_dim",
    "attn/bq": "num_attention_heads x head_dim",
    "attn/bk": "num_key_value_heads x head_dim",
    "attn/bv": "num_key_value_heads x head_dim",
    "attn/q_norm": "head_dim",
    "attn/k_norm": "head_dim",
    "attn/wo": "num_attention_heads x head_dim, hidden_size",
    "mlp/w_gate": "hidden_size, intermediate_size",
    "mlp/w_up": "hidden_size, intermediate_size",
    "mlp/w_down": "intermediate_size, hidden_size",
    "head/w": "hidden_size, vocab_size",
    "moe/router": "hidden_size, num_local_experts (num_experts)",
    "moe/expert": "hidden_size, intermediate_size (moe_intermediate_size)",
    "moe/shared": "hidden_size, shared_expert_intermediate_size",
}


def shape_fields(path, transpose: bool) -> str:
    """The ``config.json`` fields an internal parameter's HF shape comes from, in its order
    (of a fused matrix: its first part's, the outputs summed over its parts)."""
    first = path if isinstance(path, str) else path[0]
    kind = "/".join(first.rsplit("/", 2)[-2:])
    if "/moe/" in first:  # the router; an expert's matrices are shaped as the MLP's
        kind = "moe/shared" if "/moe/shared/" in first else "moe/expert"
        kind = "moe/router" if first.endswith("/router") else kind
    fields = _SHAPE_FIELDS.get(kind, "hidden_size").split(", ")
    if first.endswith("/w_down") and kind in ("moe/expert", "moe/shared"):
        fields = fields[::-1]
    if not isinstance(path, str):
        fields[-1] = "sum of " + "/".join(p.rsplit("/", 1)[-1] for p in path) + " outputs"
    return ", ".join(fields[::-1] if transpose else fields)


def _present(cfg, hf: str, internal) -> bool:
    """Whether ``cfg``'s checkpoint has the tensor of a :data:`NAME_TABLE` row."""
    if isinstance(internal, str) and "/moe/" in internal:
        if not cfg.n_experts or ("block_sparse_moe" in hf) != (cfg.moe_names == "mixtral"):
            return False
        return cfg.shared_expert_d_ff > 0 or "/shared" not in internal
    if hf.endswith(_SANDWICH) or internal == _ATTN_POST:
        return cfg.sandwich_norms
    if hf.endswith("post_attention_layernorm.weight"):  # the MLP input's norm
        return not cfg.sandwich_norms
    if isinstance(internal, tuple):
        return cfg.fused_projections
    if "/".join(internal.rsplit("/", 2)[-2:]) in _FUSED_PARTS:
        return not cfg.fused_projections
    if internal.endswith(("/bq", "/bk", "/bv")):
        return cfg.qkv_bias
    if internal.endswith(("/q_norm", "/k_norm")):
        return cfg.qk_norm
    if internal == "head/w":
        return not cfg.tie_embeddings
    return True


def expected_tensors(cfg) -> dict[str, tuple[str, bool, tuple[int, ...]]]:
    """HF name -> (internal path, transpose, HF shape) for every tensor ``cfg`` has."""
    out = {}
    for hf, internal, transpose in NAME_TABLE:
        if not _present(cfg, hf, internal):
            continue
        layers = range(cfg.n_layers) if "{i}" in hf else [None]
        if isinstance(internal, str) and "/moe/" in internal:  # the experts' layers
            layers = [i for i in layers if cfg.is_moe_layer(i)]
        elif isinstance(internal, str) and "/mlp/" in internal and cfg.n_experts:
            layers = [i for i in layers if not cfg.is_moe_layer(i)]  # the dense MLP's
        experts = range(cfg.n_experts) if "{j}" in hf else [None]
        for i, j in ((i, j) for i in layers for j in experts):
            if j is not None:  # an expert's matrix ({j}: HF's index, JJ: 2-digit)
                name = hf.format(i=i, j=j)
                path = internal.format(i=f"{i:02d}", j=f"{j:02d}")
                shape = param_shape(cfg, path)
                out[name] = (path, transpose, shape[::-1] if transpose else shape)
                continue
            name = hf if i is None else hf.format(i=i)
            if isinstance(internal, tuple):  # fused: the parts' outputs one after another
                path = tuple(p.format(i=f"{i:02d}") for p in internal)
                shapes = [param_shape(cfg, p) for p in path]
                shape = (shapes[0][0], sum(s[1] for s in shapes))
            else:
                path = internal if i is None else internal.format(i=f"{i:02d}")
                shape = param_shape(cfg, path)
            out[name] = (path, transpose, shape[::-1] if transpose else shape)
    return out


def split(cfg, path, value) -> list[tuple[str, object]]:
    """``(internal path, array)`` of a tensor read in this project's ``[in, out]`` layout: one,
    or for a fused matrix each part's columns (contiguous copies)."""
    if isinstance(path, str):
        return [(path, value)]
    import numpy as np

    widths = [param_shape(cfg, p)[1] for p in path]
    edges = np.cumsum(widths)[:-1]
    return [
        (p, np.ascontiguousarray(v))
        for p, v in zip(path, np.split(value, edges, axis=1), strict=True)
    ]


def split_stored(cfg, path, value) -> list[tuple[str, object]]:
    """:func:`split` of a tensor read as stored, ``[out, in]``: a fused matrix's parts are
    blocks of rows (contiguous views, no copy)."""
    if isinstance(path, str):
        return [(path, value)]
    import numpy as np

    edges = np.cumsum([param_shape(cfg, p)[1] for p in path])[:-1]
    return list(zip(path, np.split(value, edges, axis=0), strict=True))


def join(path, lookup):
    """The ``[in, out]`` matrix of ``path``: ``lookup(path)``, or for a fused one the parts'
    matrices side by side (what :func:`split` undoes)."""
    if isinstance(path, str):
        return lookup(path)
    import numpy as np

    return np.concatenate([np.asarray(lookup(p), np.float32) for p in path], axis=1)


def fp32_bytes(cfg) -> int:
    """Bytes of the FP32 parameters (for memory figures)."""
    return 4 * sum(math.prod(s) for _, _, s in expected_tensors(cfg).values())
