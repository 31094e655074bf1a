"""An HF ``config.json`` read into a :class:`~minifield.models.llama.LlamaConfig`, and written back.

Every field read is checked for its type (:class:`_Fields`), so a list where an object is
expected, or a string where a number is, is refused naming the file and the field, never an
``AttributeError`` later. ``null`` counts as absent (transformers writes ``"sliding_window":
null``). The model class is chosen by ``model_type``, as transformers' ``AutoModel*`` does;
``architectures``, when given, must name that same class (a ``gpt_neox`` config with Llama
``architectures`` is a contradiction, refused naming both). A config without ``model_type``
is read by its ``architectures`` entry.
"""

from __future__ import annotations

from ..models import rope_scaling
from ..models.families import (
    ARCHITECTURES,
    FAMILIES,
    FULL,
    QWEN_MAX_WINDOW_LAYERS,
    SLIDING,
    family_of,
)
from ..models.llama_config import LlamaConfig
from . import moe_config

CONFIG_FILE = "config.json"
#: ``model_type`` -> the HF causal-LM class of that type (``architectures`` entry)
MODEL_TYPES = {model_type: family.architecture for model_type, family in FAMILIES.items()}


class CheckpointError(ValueError):
    """A checkpoint this loader cannot use; the message names the file and the reason."""


def _kind_name(value) -> str:
    if value is None:
        return "null"
    return {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "a list",
        dict: "an object",
    }.get(type(value), type(value).__name__)


#: expectation -> (its words, whether a value meets it)
_KINDS = {
    "count": ("a positive integer", lambda v: type(v) is int and v > 0),
    "integer": ("an integer", lambda v: type(v) is int),
    "number": ("a number", lambda v: type(v) in (int, float)),
    "boolean": ("a boolean", lambda v: type(v) is bool),
    "string": ("a string", lambda v: type(v) is str),
    "object": ("an object", lambda v: type(v) is dict),
    "strings": ("a list of strings", lambda v: type(v) is list and all(type(x) is str for x in v)),
    "integers": (
        "a list of integers",
        lambda v: type(v) is list and all(type(x) is int for x in v),
    ),
}
_MISSING = object()


class _Fields:
    """Typed reads of one ``config.json`` object; every refusal names the file and field."""

    def __init__(self, hf, source: str):
        self.source = source
        if not isinstance(hf, dict):
            self.refuse(f"expected a JSON object, found {_kind_name(hf)}")
        self.hf = hf

    def refuse(self, reason: str):
        raise CheckpointError(f"{self.source}: {reason}")

    def get(self, field: str, kind: str, default=_MISSING):
        """``field``'s value, checked to be ``kind`` (see :data:`_KINDS`); absent or null:
        ``default``, or a refusal when there is none."""
        value = self.hf.get(field)
        if value is None:
            if default is _MISSING:
                self.refuse(f"missing key {field!r} ({_KINDS[kind][0]})")
            return default
        words, fits = _KINDS[kind]
        if not fits(value):
            self.refuse(f"{field} must be {words}, found {_kind_name(value)} {value!r}")
        return value


def _architecture(fields: _Fields) -> str:
    """The HF class: ``model_type``'s, which ``architectures`` (if given) must agree with."""
    archs = fields.get("architectures", "strings", None)
    if archs is not None and (len(archs) != 1 or archs[0] not in ARCHITECTURES):
        fields.refuse(
            f"architectures {archs!r} is not supported (expected one of {list(ARCHITECTURES)})"
        )
    model_type = fields.get("model_type", "string", None)
    if model_type is None:
        if archs is None:
            fields.refuse(f"neither model_type nor architectures (one of {list(MODEL_TYPES)})")
        return archs[0]
    if archs is not None and MODEL_TYPES.get(model_type) != archs[0]:
        fields.refuse(
            f"model_type {model_type!r} contradicts architectures {archs!r} (a "
            f"{ARCHITECTURES[archs[0]]!r} class); transformers builds the model model_type names"
        )
    if model_type not in MODEL_TYPES:
        fields.refuse(
            f"model_type {model_type!r} is not supported (expected one of {list(MODEL_TYPES)})"
        )
    return MODEL_TYPES[model_type]


#: HF ``hidden_act`` -> ``LlamaConfig.activation`` (GELU's tanh approximation has two names)
HF_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}
GEMMA_ACTIVATIONS = {**HF_ACTIVATIONS, "gelu": "gelu"}


def _activation(fields: _Fields, family) -> str:
    """The MLP gate function ``hidden_act`` names (transformers' Gemma reads it, not
    ``hidden_activation``, which must then agree with it or be absent)."""
    if family.sliding in ("gemma2", "gemma3"):  # Gemma 2 and 3 read hidden_activation
        act = fields.get("hidden_activation", "string", "gelu_pytorch_tanh")
        if act not in GEMMA_ACTIVATIONS:
            fields.refuse(f"hidden_activation {act!r} is not supported")
        return GEMMA_ACTIVATIONS[act]
    if not family.gemma:
        act = fields.get("hidden_act", "string", "silu")
        if act != "silu":
            fields.refuse(f"hidden_act {act!r} is not supported (expected 'silu')")
        return "silu"
    act = fields.get("hidden_act", "string", "gelu_pytorch_tanh")
    if act not in GEMMA_ACTIVATIONS:
        fields.refuse(
            f"hidden_act {act!r} is not supported (expected one of {list(GEMMA_ACTIVATIONS)})"
        )
    other = fields.get("hidden_activation", "string", act)
    if other != act:
        fields.refuse(f"hidden_activation {other!r} differs from hidden_act {act!r}")
    return GEMMA_ACTIVATIONS[act]


def _refuse_unsupported(fields: _Fields, arch: str) -> None:
    if fields.get("mlp_bias", "boolean", False):
        fields.refuse("mlp_bias true is not supported")
    family = FAMILIES[ARCHITECTURES[arch]]
    if family.attention_bias_field and fields.get("attention_bias", "boolean", False):
        fields.refuse("attention_bias true (an o_proj bias) is not supported")
    partial = fields.get("partial_rotary_factor", "number", 1.0)
    if partial != 1:
        fields.refuse(f"partial_rotary_factor {partial} is not supported (expected 1.0)")


def _window(fields: _Fields, arch: str, n_layers: int) -> tuple[int | None, tuple]:
    """``(sliding_window, layer_types)`` as the family reads them (see :mod:`minifield.models.families`)."""
    family = FAMILIES[ARCHITECTURES[arch]]
    window = fields.get("sliding_window", "integer", None)
    if window is not None and window < 1:
        fields.refuse(f"sliding_window must be a positive integer, found {window!r}")
    if family.sliding in ("gemma2", "gemma3"):
        pattern = 2 if family.sliding == "gemma2" else 6
        if family.sliding == "gemma3":
            pattern = fields.get("sliding_window_pattern", "count", pattern)
            if fields.get("use_bidirectional_attention", "boolean", False):
                fields.refuse("use_bidirectional_attention true is not supported (causal only)")
        types = fields.get("layer_types", "strings", None)
        types = types or [SLIDING if (i + 1) % pattern else FULL for i in range(n_layers)]
        window = 4096 if "sliding_window" not in fields.hf else window  # absent: the default
        if window is None:  # transformers would still rotate those layers by the local base
            fields.refuse("sliding_window null is not supported for this model_type")
        return _checked_types(fields, window, types, n_layers)
    if family.sliding == "all":
        # a window reaching every position the model has is no window (Mistral's own configs)
        max_pos = fields.get("max_position_embeddings", "count", None)
        return (window, ()) if window is not None and window < (max_pos or 0) else (None, ())
    if family.sliding != "qwen" or not fields.get("use_sliding_window", "boolean", False):
        return None, ()
    if "sliding_window" not in fields.hf:
        window = 4096  # transformers' Qwen default when the key is absent (null: no window)
    types = fields.get("layer_types", "strings", None)
    if types is None:
        first_sliding = fields.get("max_window_layers", "integer", QWEN_MAX_WINDOW_LAYERS)
        types = [SLIDING if i >= first_sliding else FULL for i in range(n_layers)]
    return _checked_types(fields, window, types, n_layers)


def _checked_types(fields: _Fields, window, types: list, n_layers: int) -> tuple:
    """``(sliding_window, layer_types)`` of a per-layer ``layer_types`` list, checked."""
    if len(types) != n_layers or not set(types) <= {SLIDING, FULL}:
        fields.refuse(
            f"layer_types must be {n_layers} (num_hidden_layers) of {SLIDING!r}, {FULL!r}; "
            f"found {types!r}"
        )
    if window is None or SLIDING not in types:
        return None, ()
    return window, () if set(types) == {SLIDING} else tuple(types)


def config_from_hf(
    hf, source: str = CONFIG_FILE, max_len: int | None = None, compute_dtype="bfloat16"
) -> LlamaConfig:
    """The :class:`LlamaConfig` an HF ``config.json`` describes; refuses what we do not run."""
    fields = _Fields(hf, source)
    arch = _architecture(fields)
    family = FAMILIES[ARCHITECTURES[arch]]
    _refuse_unsupported(fields, arch)
    heads = fields.get("num_attention_heads", "count")
    hidden = fields.get("hidden_size", "count")
    head_dim = fields.get("head_dim", "count", family.default_head_dim)
    max_positions = fields.get("max_position_embeddings", "count", None)
    if max_len is None:
        max_len = fields.get("max_position_embeddings", "count")
    scaling = fields.get("rope_scaling", "object", None)
    if scaling is not None:
        # top level in Phi-3's config.json (transformers' longrope reads it from any config)
        original = fields.get("original_max_position_embeddings", "count", None)
        half = head_dim // 2 if head_dim else hidden // heads // 2
        scaling = rope_scaling.read(scaling, fields.refuse, max_len, max_positions, original, half)
    scaling = scaling or ()
    n_layers = fields.get("num_hidden_layers", "count")
    experts = moe_config.experts(fields, family, n_layers)
    if family.model_type == "olmoe" and head_dim not in (None, hidden // heads):
        fields.refuse(f"head_dim {head_dim} is not supported (OLMoE's is hidden_size / heads)")
    qkv_bias = family.qkv_bias
    if family.model_type == "qwen2_moe":
        qkv_bias = fields.get("qkv_bias", "boolean", True)
    window, layer_types = _window(fields, arch, n_layers)
    activation = _activation(fields, family)
    sandwich = family.sliding in ("gemma2", "gemma3")
    default_caps = (50.0, 30.0) if family.sliding == "gemma2" else (None, None)
    caps = {
        "query_pre_attn_scalar": float(fields.get("query_pre_attn_scalar", "number", 256)),
        "attn_softcap": fields.get("attn_logit_softcapping", "number", default_caps[0]),
        "final_softcap": fields.get("final_logit_softcapping", "number", default_caps[1]),
    }
    if "attn_logit_softcapping" in hf and hf["attn_logit_softcapping"] is None:
        caps["attn_softcap"] = None  # null: none (absent: transformers' default)
    if "final_logit_softcapping" in hf and hf["final_logit_softcapping"] is None:
        caps["final_softcap"] = None
    caps = {k: None if v is None else float(v) for k, v in caps.items()} if sandwich else {}
    if family.sliding == "gemma3":
        caps["rope_local_theta"] = float(fields.get("rope_local_base_freq", "number", 10000.0))
    sizes = {
        "vocab_size": fields.get("vocab_size", "count"),
        "d_model": hidden,
        "n_layers": n_layers,
        "n_heads": heads,
        "n_kv_heads": fields.get("num_key_value_heads", "count", heads),
        "d_ff": fields.get("intermediate_size", "count"),
        "max_len": max_len,
        "rope_theta": float(fields.get("rope_theta", "number", family.default_rope_theta)),
        "norm_eps": float(fields.get("rms_norm_eps", "number", 1e-6)),
        "tie_embeddings": fields.get("tie_word_embeddings", "boolean", family.gemma),
    }
    try:
        return LlamaConfig(
            **sizes,
            qkv_bias=qkv_bias,
            compute_dtype=compute_dtype,
            rope_scaling=scaling,
            head_dim=head_dim,
            qk_norm=family.qk_norm,
            fused_projections=family.fused_projections,
            activation=activation,
            norm_plus_one=family.gemma,
            scale_embeddings=family.gemma,
            sandwich_norms=sandwich,
            **caps,
            sliding_window=window,
            layer_types=layer_types,
            **experts,
        )
    except ValueError as e:  # the model's own checks (heads dividing, positive sizes, ...)
        fields.refuse(str(e))


def config_to_hf(cfg: LlamaConfig) -> dict:
    """``config.json`` for an export without a base model's: the simplest family that holds
    the model (:func:`minifield.models.families.family_of`)."""
    family = family_of(cfg)
    if cfg.qkv_bias and not family.qkv_bias:
        raise ValueError(
            f"no HF family holds q/k/v biases with this model's other features "
            f"(written as {family.model_type}, which has none)"
        )
    out = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": {v: k for k, v in reversed(GEMMA_ACTIVATIONS.items())}[cfg.activation],
        "max_position_embeddings": cfg.max_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": rope_scaling.to_hf(cfg.rope_scaling),
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": cfg.tie_embeddings,
        "torch_dtype": "float32",
    }
    if cfg.sliding_window is not None:
        if not family.sliding:
            raise ValueError(f"no HF family holds {cfg} (per-layer windows without qwen's biases)")
        out["sliding_window"] = cfg.sliding_window
    types = list(cfg.layer_types) or [SLIDING] * cfg.n_layers
    if cfg.sliding_window is not None and family.sliding == "qwen":
        full = next((i for i, t in enumerate(types) if t == SLIDING), cfg.n_layers)
        out.update(use_sliding_window=True, max_window_layers=full, layer_types=types)
    if family.sliding == "gemma3":
        out["rope_local_base_freq"] = cfg.rope_local_theta
    if family.moe:
        out.update(moe_config.experts_to_hf(cfg, family.model_type))
    if family.model_type == "olmoe":
        del out["head_dim"]  # OLMoE's is hidden_size / heads; it has no such field
    if family.sliding in ("gemma2", "gemma3"):
        out.update(
            hidden_activation=out["hidden_act"],
            query_pre_attn_scalar=cfg.query_pre_attn_scalar,
            attn_logit_softcapping=cfg.attn_softcap,
            final_logit_softcapping=cfg.final_softcap,
            layer_types=types if cfg.sliding_window is not None else [FULL] * cfg.n_layers,
        )
    return out
