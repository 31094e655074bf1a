"""The configuration of a Llama-family model (:mod:`.llama` computes it): sizes, rotary,
norms, biases, q/k norms, head width and sliding windows, with their checks and their
``to_dict`` form (an export's ``model.json``)."""

from __future__ import annotations

from dataclasses import dataclass

from .. import schemas
from . import families
from . import rope_scaling as scaling
from .execution import Execution, fused_kernel
from .layers.architecture import ArchitectureConfig

ARCHITECTURE = "llama"
#: what an absent ``rope_theta``, ``norm_eps``, ``qkv_bias`` mean: the recipe schema says
#: the MLP gate functions :mod:`.llama` computes
ACTIVATIONS = ("silu", "gelu_tanh", "gelu")
_ABSENT = schemas.absent(schemas.PACKED_SFT, "model")


#: ``to_dict`` leaves a field out at this value (``head_dim``: at ``d_model / n_heads``), so
#: configs written before the field existed keep their recorded form
_UNSET = {
    "rope_scaling": {},
    "qk_norm": False,
    "fused_projections": False,
    "activation": "silu",
    "norm_plus_one": False,
    "scale_embeddings": False,
    "sandwich_norms": False,
    "query_pre_attn_scalar": None,
    "attn_softcap": None,
    "final_softcap": None,
    "rope_local_theta": None,
    "sliding_window": None,
    "layer_types": [],
    "n_experts": 0,
    "experts_per_token": 0,
    "moe_d_ff": 0,
    "shared_expert_d_ff": 0,
    "dense_layers": [],
    "norm_topk": True,
    "qk_norm_whole": False,
    "moe_names": "mixtral",
}
#: what the model is trained with, not what it computes: ``to_dict`` (an export's
#: ``model.json``) leaves them out, as ``execution``
_TRAINING_ONLY = ("router_aux_coef", "router_z_coef")


@dataclass(frozen=True)
class LlamaConfig(ArchitectureConfig):
    """Architecture and precision of a Llama-family model (hashable: a static jit argument)."""

    architecture = ARCHITECTURE
    INTEGER_FIELDS = (
        "vocab_size",
        "d_model",
        "n_layers",
        "n_heads",
        "n_kv_heads",
        "d_ff",
        "max_len",
    )
    FLAG_FIELDS = (
        "qkv_bias",
        "tie_embeddings",
        "qk_norm",
        "fused_projections",
        "norm_plus_one",
        "scale_embeddings",
        "sandwich_norms",
        "norm_topk",
        "qk_norm_whole",
    )

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    max_len: int
    rope_theta: float = _ABSENT["rope_theta"]
    norm_eps: float = _ABSENT["norm_eps"]
    qkv_bias: bool = _ABSENT["qkv_bias"]
    tie_embeddings: bool = False
    compute_dtype: str = "bfloat16"
    #: ``rope_scaling`` as sorted (key, value) pairs, empty for the plain rotary (:mod:`.rope_scaling`)
    rope_scaling: tuple = ()
    #: width of a query/key/value head (None: ``d_model / n_heads``; Qwen3 sets it apart)
    head_dim: int | None = None
    #: RMSNorm of every query and key head before rotary (Qwen3's q_norm, k_norm)
    qk_norm: bool = False
    #: the MLP's gate function: silu (SwiGLU), gelu_tanh or gelu (Gemma's GeGLU)
    activation: str = "silu"
    #: RMSNorm multiplies by ``1 + scale`` (Gemma), not ``scale``
    norm_plus_one: bool = False
    #: token embeddings multiplied by ``sqrt(d_model)`` in the compute dtype (Gemma)
    scale_embeddings: bool = False
    #: a norm on the attention output and on the MLP output too (Gemma 2's four per layer)
    sandwich_norms: bool = False
    #: attention scores scaled by ``query_pre_attn_scalar ** -0.5`` (None: head_dim's)
    query_pre_attn_scalar: float | None = None
    #: soft-capping ``cap * tanh(x / cap)`` of the attention scores and of the logits
    attn_softcap: float | None = None
    final_softcap: float | None = None
    #: the rotary base of the sliding-window layers (Gemma 3's ``rope_local_base_freq``, no
    #: ``rope_scaling`` there); None: every layer's is ``rope_theta``
    rope_local_theta: float | None = None
    #: an HF checkpoint's layout, not the function: q/k/v and gate/up stored fused (Phi-3)
    fused_projections: bool = False
    #: a query sees the keys of its segment less than this many positions back (itself
    #: included); None: the whole segment (see :func:`minifield.models.layers.attention.window_mask`)
    sliding_window: int | None = None
    #: per layer ``sliding_attention`` or ``full_attention`` (:mod:`.families`); empty: the
    #: window, if any, applies to every layer
    layer_types: tuple = ()
    #: a mixture of experts in place of each MLP (Mixtral, :mod:`.moe`): this many experts of
    #: width ``d_ff``, each token through ``experts_per_token`` of them; 0: the dense MLP
    n_experts: int = 0
    experts_per_token: int = 0
    #: each expert's width (0: ``d_ff``; Qwen-MoE's ``moe_intermediate_size``, ``d_ff`` then
    #: being the dense layers' width)
    moe_d_ff: int = 0
    #: a shared expert of this width on every token, times ``sigmoid(x @ shared_gate)``
    #: (Qwen2-MoE); 0: none
    shared_expert_d_ff: int = 0
    #: with experts, the layers that keep the dense MLP of width ``d_ff`` (Qwen-MoE's
    #: ``mlp_only_layers`` and ``decoder_sparse_step``); empty: every layer has experts
    dense_layers: tuple = ()
    #: the top-k router probabilities divided by their sum (Mixtral; Qwen-MoE's and OLMoE's
    #: ``norm_topk_prob``)
    norm_topk: bool = True
    #: the q/k norms over the whole projected queries ``[H*K]`` and keys ``[G*K]`` (OLMoE),
    #: not per head
    qk_norm_whole: bool = False
    #: an HF checkpoint's layout, not the function: the experts' tensor names, "mixtral"
    #: (``block_sparse_moe.experts.{j}.w1``) or "mlp" (``mlp.experts.{j}.gate_proj``)
    moe_names: str = "mixtral"
    #: the router's load-balancing loss times this is added to the training loss
    #: (``output_router_logits`` true: ``router_aux_loss_coef``, :mod:`.router_loss`); None:
    #: not computed (the language-model loss alone)
    router_aux_coef: float | None = None
    #: the router z-loss times this is added to the training loss (the recipe's
    #: ``model.router_z_loss_coef``); 0: not computed
    router_z_coef: float = 0.0
    #: how it computes, not architecture: ``to_dict`` leaves it out (see :mod:`.execution`)
    execution: Execution = Execution()

    def __post_init__(self):
        if isinstance(self.rope_scaling, dict):  # to_dict's form (model.json)
            object.__setattr__(self, "rope_scaling", scaling.from_dict(self.rope_scaling))
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "dense_layers", tuple(self.dense_layers))
        sizes = (self.d_model, self.n_heads)
        if self.head_dim is None and all(type(v) is int and v > 0 for v in sizes):
            if self.d_model % self.n_heads == 0:
                object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        super().__post_init__()

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer ``layer`` (None: it attends to its whole segment)."""
        if self.layer_types and self.layer_types[layer] != families.SLIDING:
            return None
        return self.sliding_window

    def architecture_errors(self, sizes_valid: bool) -> list[str]:
        errors = []
        if sizes_valid:
            if self.head_dim is None:
                errors.append(
                    f"model.d_model: {self.d_model} is not divisible by model.n_heads={self.n_heads}"
                )
            elif type(self.head_dim) is not int or self.head_dim < 1:
                errors.append(f"model.head_dim: expected a positive integer, got {self.head_dim!r}")
            elif self.head_dim % 2:
                errors.append(f"model.n_heads: rotary needs an even head size, got {self.head_dim}")
            if self.n_heads % self.n_kv_heads:
                errors.append(
                    f"model.n_kv_heads: {self.n_kv_heads} does not divide "
                    f"model.n_heads={self.n_heads}"
                )
        for name in ("rope_theta", "norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, float) or not value > 0:
                errors.append(f"model.{name}: expected a positive float, got {value!r}")
        if self.activation not in ACTIVATIONS:
            errors.append(
                f"model.activation: expected one of {ACTIVATIONS}, got {self.activation!r}"
            )
        for name in ("query_pre_attn_scalar", "attn_softcap", "final_softcap", "rope_local_theta"):
            value = getattr(self, name)
            if value is not None and (type(value) is not float or not value > 0):
                errors.append(f"model.{name}: expected a positive float, got {value!r}")
        if self.attn_softcap is not None and _gpu_fused(self):
            errors.append(
                "model.attention pallas: the fused kernel has no score soft-capping "
                f"(attn_logit_softcapping {self.attn_softcap}) off a TPU; use model.attention "
                "xla, or runtime.backend tpu"
            )
        return errors + window_errors(self) + expert_errors(self)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer`` has the experts in place of the dense MLP."""
        return bool(self.n_experts) and layer not in self.dense_layers

    @property
    def expert_d_ff(self) -> int:
        return self.moe_d_ff or self.d_ff

    @property
    def score_scale(self) -> float:
        """The factor attention scores are multiplied by before the softmax."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def to_dict(self) -> dict:
        out = {"architecture": ARCHITECTURE, **super().to_dict()}
        for key in _TRAINING_ONLY:
            del out[key]
        out["rope_scaling"] = scaling.to_hf(self.rope_scaling) or {}
        out["layer_types"] = list(self.layer_types)
        out["dense_layers"] = list(self.dense_layers)
        # configs without them keep their recorded form (model.json of earlier exports)
        divides = self.d_model % self.n_heads == 0
        unset = {**_UNSET, "head_dim": self.d_model // self.n_heads if divides else None}
        for key, value in unset.items():
            if out[key] == value:
                del out[key]
        return out


def window_errors(cfg: LlamaConfig) -> list[str]:
    """The sliding window's and the layer types' errors."""
    window, types = cfg.sliding_window, cfg.layer_types
    if window is None:
        return ["model.layer_types: only with a sliding window"] if types else []
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        return [f"model.sliding_window: expected a positive integer, got {window!r}"]
    errors = []
    if types and (
        len(types) != cfg.n_layers or not set(types) <= {families.SLIDING, families.FULL}
    ):
        errors.append(
            f"model.layer_types: expected {cfg.n_layers} of {families.SLIDING!r}, "
            f"{families.FULL!r}; got {list(types)}"
        )
    elif len(set(types)) > 1 and cfg.execution.scan_layers:
        errors.append(
            "model.scan_layers: layers with and without a sliding window (layer_types) "
            "cannot share one scanned body; leave scan_layers false"
        )
    if window < cfg.max_len and _gpu_fused(cfg):
        errors.append(
            f"model.attention pallas: the fused kernel has no sliding window, and "
            f"sliding_window {window} < the rows' {cfg.max_len} positions; off a TPU, use "
            "model.attention xla (splash attention, runtime.backend tpu, has windows)"
        )
    return errors


def _gpu_fused(cfg: LlamaConfig) -> bool:
    """Whether ``cfg`` computes attention with the GPU fused kernel, which has neither
    windows nor soft-capping (splash attention, on a TPU, has both)."""
    return cfg.execution.attention == "pallas" and fused_kernel(cfg.execution.backend) == "mha"


def expert_errors(cfg: LlamaConfig) -> list[str]:
    """The mixture-of-experts fields' errors (:mod:`.moe`)."""
    n, k = cfg.n_experts, cfg.experts_per_token
    sizes = (n, k, cfg.moe_d_ff, cfg.shared_expert_d_ff)
    if any(type(v) is not int or v < 0 for v in sizes):
        return [
            "model.n_experts, experts_per_token, moe_d_ff, shared_expert_d_ff: expected "
            f"integers >= 0, got {sizes!r}"
        ]
    errors = []
    if cfg.moe_names not in ("mixtral", "mlp"):
        errors.append(f"model.moe_names: expected mixtral or mlp, got {cfg.moe_names!r}")
    if not all(type(i) is int and 0 <= i < cfg.n_layers for i in cfg.dense_layers):
        errors.append(
            f"model.dense_layers: expected layer indices below {cfg.n_layers}, "
            f"got {list(cfg.dense_layers)}"
        )
    if (n, k) == (0, 0):
        if cfg.dense_layers or cfg.moe_d_ff or cfg.shared_expert_d_ff:
            errors.append("model.dense_layers, moe_d_ff, shared_expert_d_ff: only with experts")
        if cfg.router_aux_coef is not None or cfg.router_z_coef:
            errors.append("model.router_z_loss_coef: only for a base model with experts (a router)")
        return errors
    if n < 1 or not 1 <= k <= n:
        errors.append(
            f"model.experts_per_token: expected 1 to n_experts={n} (both 0: no experts), got {k}"
        )
    if cfg.dense_layers and cfg.execution.scan_layers:
        errors.append(
            "model.scan_layers: layers with experts and with the dense MLP (dense_layers) "
            "cannot share one scanned body; leave scan_layers false"
        )
    return errors
