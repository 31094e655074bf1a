"""Per-token log-probabilities of completions under a policy, as the GRPO objective reads them.

A row holds a prompt and its completion from slot 0 (one segment, positions 0, 1, …, padding
after the completion). The log-probability of the token in slot ``t`` is read from the logits
of slot ``t - 1`` divided by the sampling temperature, over the **whole** vocabulary: the
policy being trained is the temperature-scaled softmax, whatever top-k or top-p cut off when
sampling (docs/grpo.md says what that means for the ratio). Slot 0 has none (0). The
token's entropy (of that same distribution) is returned beside it for the metrics. Both come
from :func:`minifield.models.cross_entropy.target_logps`, in chunks of
``training.loss_chunk_tokens`` tokens when the recipe sets it.
"""

from __future__ import annotations

import jax.numpy as jnp

from ..models import model
from ..models.cross_entropy import target_logps


def token_logps(params, cfg, tokens_NxS, temperature: float):
    """``(logps_NxS, entropy_NxS)``, FP32, aligned with the tokens (slot 0: zeros)."""
    N, S = tokens_NxS.shape
    segments_NxS = jnp.ones((N, S), jnp.int32)
    positions_NxS = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (N, S))
    h_NxSxD = model.hidden(params, cfg, tokens_NxS, segments_NxS, positions_NxS)

    def scaled_head(h_BxTxD):
        return model.head(params, cfg, h_BxTxD).astype(jnp.float32) / temperature

    picked_NxS, entropy_NxS = target_logps(
        scaled_head,
        h_NxSxD[:, :-1],
        tokens_NxS[:, 1:],
        cfg.execution.loss_chunk_tokens,
        entropy=True,
    )
    zeros_Nx1 = jnp.zeros((N, 1), jnp.float32)
    return (
        jnp.concatenate([zeros_Nx1, picked_NxS], axis=1),
        jnp.concatenate([zeros_Nx1, entropy_NxS], axis=1),
    )
