"""The minimal loops the benchmarks measure minifield against, in one place: each the same
model written from the equations in plain JAX + optax, with nothing of minifield's program
around it, so that ours ÷ minimal says what our code costs beyond the model.

- :mod:`.llama`: the Llama training step (``device_check``'s step sections, ``llama_step.py``;
  its logits under a GRPO loss in ``grpo_update.py``);
- :mod:`.experts`: mixtures of experts as its MLP (``moe_update.py``, ``moe_chip.py``);
- :mod:`.decode`: a key/value-cache sampling loop (``grpo_rollouts.py``).

Import them with the benchmarks directory on the path: ``from minimal import llama``.
"""
