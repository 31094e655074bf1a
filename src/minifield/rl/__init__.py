"""Reinforcement learning on verifiable rewards: the library the ``grpo`` strategy is built on.

Rewards over completions (:mod:`.rewards`, a user's Python function in its own process:
:mod:`.python_reward`), group advantages and each loss type's token weights (:mod:`.advantages`,
host-side NumPy), the policy objective (:mod:`.objective`, JAX; docs/grpo-objective.md),
reproducible rollouts from the policy's key/value-cache generation (:mod:`.rollouts`) and the
per-token log-probabilities the objective reads (:mod:`.logprobs`). It sits beside
:mod:`minifield.training` on the model wing and imports no strategy. See docs/grpo.md.
"""
