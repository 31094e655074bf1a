"""The mixture-of-experts fields of an HF ``config.json`` (Mixtral, Qwen2-MoE, Qwen3-MoE,
OLMoE; docs/moe.md), read into a :class:`~minifield.models.llama.LlamaConfig`'s expert
fields and written back: :mod:`.config` reads and writes the rest."""

from __future__ import annotations

from ..models.llama_config import LlamaConfig

#: per MoE ``model_type``: transformers' config defaults of the expert count, top-k,
#: ``norm_topk_prob`` (Mixtral: always renormalised, no such field)
MOE_DEFAULTS = {
    "mixtral": (8, 2, True),
    "qwen2_moe": (60, 4, False),
    "qwen3_moe": (128, 8, False),
    "olmoe": (64, 8, False),
}


def experts(fields, family, n_layers: int) -> dict:
    """The mixture of experts of a MoE family, ``fields`` its ``config.json`` read as
    :mod:`.config` reads it (absent fields: transformers' defaults, see
    :data:`MOE_DEFAULTS`); ``output_router_logits`` true turns on the router's
    load-balancing loss in training, ``router_aux_loss_coef`` times it added to the loss
    (``router_aux_coef``; false: None, the language-model loss alone, as transformers). What
    is not computed is refused naming the field: a router jitter (training noise on the
    router's input), Qwen-MoE's sliding window, OLMoE's ``clip_qkv``."""
    if not family.moe:
        return {}
    kind = family.model_type
    n_default, k_default, norm_default = MOE_DEFAULTS[kind]
    n = fields.get("num_local_experts" if kind == "mixtral" else "num_experts", "count", n_default)
    k = fields.get("num_experts_per_tok", "count", k_default)
    if k > n:
        experts_field = "num_local_experts" if kind == "mixtral" else "num_experts"
        fields.refuse(f"num_experts_per_tok {k} exceeds {experts_field} {n}")
    jitter = fields.get("router_jitter_noise", "number", 0.0)
    if jitter != 0:
        fields.refuse(
            f"router_jitter_noise {jitter} is not supported (expected 0: the router's input "
            "is not perturbed)"
        )
    # transformers' defaults: OLMoE 0.01, the others 0.001
    coef = fields.get("router_aux_loss_coef", "number", 0.01 if kind == "olmoe" else 0.001)
    if coef < 0:
        fields.refuse(f"router_aux_loss_coef {coef} is negative (expected >= 0)")
    out = {"n_experts": n, "experts_per_token": k}
    if fields.get("output_router_logits", "boolean", False):
        out["router_aux_coef"] = float(coef)
    if kind == "mixtral":
        return out
    out["moe_names"] = "mlp"
    out["norm_topk"] = fields.get("norm_topk_prob", "boolean", norm_default)
    if kind == "olmoe":
        clip = fields.get("clip_qkv", "number", None)
        if clip is not None:
            fields.refuse(f"clip_qkv {clip} is not supported (expected null: q/k/v not clamped)")
        out["qk_norm_whole"] = True
        return out
    if fields.get("use_sliding_window", "boolean", False):
        fields.refuse(f"use_sliding_window true is not supported for model_type {kind}")
    out["moe_d_ff"] = fields.get(
        "moe_intermediate_size", "count", 1408 if kind == "qwen2_moe" else 768
    )
    if kind == "qwen2_moe":
        out["shared_expert_d_ff"] = fields.get("shared_expert_intermediate_size", "count", 5632)
    step = fields.get("decoder_sparse_step", "count", 1)
    only = fields.get("mlp_only_layers", "integers", [])
    if not all(0 <= i < n_layers for i in only):
        fields.refuse(f"mlp_only_layers {only} names layers outside 0..{n_layers - 1}")
    # transformers' Qwen-MoE decoder layer: experts unless listed or not a step's multiple
    out["dense_layers"] = tuple(i for i in range(n_layers) if i in only or (i + 1) % step)
    return out


def experts_to_hf(cfg: LlamaConfig, model_type: str) -> dict:
    """A MoE family's own ``config.json`` fields (what :func:`experts` reads back)."""
    out = {
        "num_experts_per_tok": cfg.experts_per_token,
        "output_router_logits": cfg.router_aux_coef is not None,
    }
    coef = cfg.router_aux_coef
    if model_type == "mixtral":
        if cfg.dense_layers or not cfg.norm_topk or cfg.moe_names != "mixtral" or cfg.qkv_bias:
            raise ValueError(f"no HF family holds {cfg} (experts without Mixtral's layout)")
        return {
            **out,
            "num_local_experts": cfg.n_experts,
            "router_aux_loss_coef": 0.001 if coef is None else coef,
            "router_jitter_noise": 0.0,
        }
    out.update(num_experts=cfg.n_experts, norm_topk_prob=cfg.norm_topk)
    if model_type == "olmoe":
        if cfg.dense_layers or cfg.moe_d_ff not in (0, cfg.d_ff) or cfg.qkv_bias:
            raise ValueError(f"no HF family holds {cfg} (OLMoE has no dense layers nor biases)")
        return {**out, "router_aux_loss_coef": 0.01 if coef is None else coef, "clip_qkv": None}
    out.update(
        router_aux_loss_coef=0.001 if coef is None else coef,
        moe_intermediate_size=cfg.expert_d_ff,
        decoder_sparse_step=1,
        mlp_only_layers=list(cfg.dense_layers),
        use_sliding_window=False,
    )
    if model_type == "qwen2_moe":
        out.update(shared_expert_intermediate_size=cfg.shared_expert_d_ff, qkv_bias=cfg.qkv_bias)
    elif cfg.qkv_bias:
        raise ValueError(f"no HF family holds {cfg} (Qwen3-MoE has no q/k/v biases)")
    return out
