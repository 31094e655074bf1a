"""Which parameters a LoRA target adapts (``model.lora.targets``, :mod:`minifield.training.lora`).

A target is a module name as PEFT users write them in ``target_modules``: PEFT adapts every
``nn.Linear`` whose HF name ends in ``.`` + that name. So in a dense layer ``q_proj`` ...
``down_proj`` are the attention's and the MLP's projections; in a mixture's layer
(:mod:`.moe`) the attention's as well, and: Mixtral's experts ``block_sparse_moe.experts.{j}.w1``
(gate), ``w3`` (up), ``w2`` (down); Qwen-MoE's and OLMoE's ``mlp.experts.{j}.gate_proj`` /
``up_proj`` / ``down_proj``, which the same names also find in Qwen2-MoE's shared expert
(``mlp.shared_expert.gate_proj``) and in the dense layers (``mlp.gate_proj``); ``gate`` the
router (``block_sparse_moe.gate``, ``mlp.gate``; not Qwen2-MoE's ``shared_expert_gate``,
whose name ends in ``_gate``). Importing it does not import JAX (recipe validation and the
prepare stage check targets with it).
"""

from __future__ import annotations

#: PEFT target module name -> the internal parameter it adapts in a dense layer (None: in a
#: mixture's layer only); the order is the initialisation draw's target index
TARGETS = {
    "q_proj": "attn/wq",
    "k_proj": "attn/wk",
    "v_proj": "attn/wv",
    "o_proj": "attn/wo",
    "gate_proj": "mlp/w_gate",
    "up_proj": "mlp/w_up",
    "down_proj": "mlp/w_down",
    "w1": None,  # Mixtral's experts: block_sparse_moe.experts.{j}.w1 (gate), w3 (up), w2 (down)
    "w3": None,
    "w2": None,
    "gate": None,  # the router: Mixtral's block_sparse_moe.gate, the others' mlp.gate
}
#: the expert projection each name adapts in a mixture's layer (Mixtral's own names; the
#: Qwen-MoE/OLMoE experts and shared expert are named as a dense MLP)
_EXPERT_LEAF = {"w1": "w_gate", "w3": "w_up", "w2": "w_down"}
_MLP_LEAF = {"gate_proj": "w_gate", "up_proj": "w_up", "down_proj": "w_down"}
#: where the experts' stacked adapters are in a layer's adapters (:mod:`minifield.training.lora`)
EXPERTS = ("moe", "experts")


def target_paths(cfg, layer: int, name: str) -> list[str]:
    """The internal parameters (under ``blocks/NN``) that target ``name`` adapts in layer
    ``layer``: the modules whose HF name ends in ``.name``, as PEFT's ``target_modules``
    match them. In a mixture's layer the Qwen-MoE/OLMoE MLP names adapt every expert (and
    Qwen2-MoE's shared expert), Mixtral's ``w1``/``w3``/``w2`` its experts, ``gate`` the
    router; a dense layer (any dense model's; Qwen's ``mlp_only_layers``) has its MLP."""
    if not cfg.is_moe_layer(layer):
        return [TARGETS[name]] if TARGETS[name] else []
    if TARGETS[name] and TARGETS[name].startswith("attn/"):
        return [TARGETS[name]]
    if name == "gate":
        return ["moe/router"]
    mixtral = cfg.moe_names == "mixtral"
    if name in _EXPERT_LEAF:
        return [f"moe/experts/{_EXPERT_LEAF[name]}"] if mixtral else []
    leaf = _MLP_LEAF[name]
    if mixtral:
        return []
    return [f"moe/experts/{leaf}"] + ([f"moe/shared/{leaf}"] if cfg.shared_expert_d_ff else [])


def unmatched_targets(cfg, targets) -> list[str]:
    """The targets that name no module of ``cfg``'s model (PEFT would leave them unused)."""
    return [
        name for name in targets if not any(target_paths(cfg, i, name) for i in range(cfg.n_layers))
    ]
