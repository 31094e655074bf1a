"""Group advantages and the loss types' token weights: host-side NumPy, no JAX.

What the ``grpo`` strategy computes once per update, before any device step: the advantage of
each completion from its reward (:func:`advantages`) and, for the update's loss type, the weight
of each completion token in the update's loss (:func:`token_weights`). Both follow TRL's
``GRPOTrainer`` (``trl/trainer/grpo_trainer.py``: ``_generate_and_score_completions`` for the
advantages, ``_compute_loss`` for the normalisations); docs/grpo-objective.md writes them out
and names the one place this differs (the loss as token weights over the whole update, which
only TRL's ``bnpo`` notices: its micro-batches are ours, every M-th row, not shuffled).

The device side, the per-token loss the weights multiply, is :mod:`minifield.rl.objective`.
"""

from __future__ import annotations

import numpy as np

__all__ = ["LOSS_TYPES", "SCALE_REWARDS", "advantages", "token_weights"]

#: how a loss type normalises the sum of its per-token losses (TRL's ``loss_type`` values)
LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "bnpo")
#: what the centred rewards are divided by (TRL's ``scale_rewards`` values)
SCALE_REWARDS = ("group", "batch", "none")

#: TRL's constant in ``advantages / (std_rewards + 1e-4)``: a group of equal rewards gets 0
STD_EPSILON = 1e-4


def _nan_mean_std(x: np.ndarray, axis: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Mean and Bessel-corrected (ddof=1) standard deviation over the non-NaN values, as TRL's
    ``torch.nanmean`` and ``trl.trainer.utils.nanstd``: NaN where fewer than 1 (mean) or 2
    (standard deviation) values are left, without NumPy's warnings for those."""
    present = ~np.isnan(x)
    count = present.sum(axis=axis)
    values = np.where(present, x, 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = values.sum(axis=axis) / count
        centred = np.where(present, x - (mean if axis is None else np.expand_dims(mean, axis)), 0.0)
        variance = (centred**2).sum(axis=axis) / (count - 1)
    std = np.sqrt(np.where(count > 1, variance, np.nan))
    return mean, std


def advantages(rewards_N: np.ndarray, num_generations: int, scale_rewards: str) -> np.ndarray:
    """The advantage of each completion, float64 ``[N]``.

    Completions of one prompt are consecutive: group ``g`` is rows ``g·G … g·G + G − 1`` for
    ``G = num_generations``. As TRL (``multi_objective_aggregation="sum_then_normalize"``, its
    default): ``A_i = r_i − mean(group of i)``, then divided by ``std + 1e-4`` where ``std`` is
    the group's (``"group"``) or all N rewards' (``"batch"``) Bessel-corrected standard deviation
    (TRL's ``nanstd``: torch's convention, ddof=1); ``"none"`` leaves ``A`` unscaled. A group of
    equal rewards gets 0. With ``G == 1`` (``"group"``) or ``N == 1`` (``"batch"``) the standard
    deviation is 0, as TRL sets it there (no Bessel correction of one value).

    A NaN reward (a completion no reward scored) is left out of the means and deviations and
    gets advantage 0, as TRL's ``unscorable_mask`` and ``nan_to_num``; an infinite one is an
    error (no reward of ours should produce one).
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {scale_rewards!r}")
    rewards_N = np.asarray(rewards_N, dtype=np.float64)
    if rewards_N.ndim != 1:
        raise ValueError(f"rewards_N must be one-dimensional, got shape {rewards_N.shape}")
    n, g = rewards_N.shape[0], int(num_generations)
    if g < 1 or n % g:
        raise ValueError(
            f"num_generations must divide the {n} rewards into whole groups, got {num_generations}"
        )
    if np.isinf(rewards_N).any():
        rows = np.flatnonzero(np.isinf(rewards_N)).tolist()
        raise ValueError(f"rewards_N holds an infinite reward at rows {rows}")
    grouped_PxG = rewards_N.reshape(-1, g)  # P prompts, G completions each
    group_mean_P, group_std_P = _nan_mean_std(grouped_PxG, axis=1)
    adv_N = rewards_N - np.repeat(group_mean_P, g)
    if scale_rewards == "group":
        adv_N = adv_N / ((np.repeat(group_std_P, g) if g > 1 else 0.0) + STD_EPSILON)
    elif scale_rewards == "batch":
        adv_N = adv_N / ((_nan_mean_std(rewards_N, axis=None)[1] if n > 1 else 0.0) + STD_EPSILON)
    return np.nan_to_num(adv_N, nan=0.0)


def token_weights(
    loss_type: str, mask_NxT: np.ndarray, max_completion_length: int, micro_batches: int = 1
) -> np.ndarray:
    """The weight ``w`` of each completion token in the loss of the whole update, float32
    ``[N, T]``: the update's loss is ``Σ w · per_token_loss`` over N completions and one
    optimizer step, so summing the micro-batches' ``Σ w · loss`` is that loss exactly, however
    the rows are split (the weights carry every normaliser that spans micro-batches).

    With ``len_i`` completion ``i``'s active tokens (``mask`` row sum) and ``L`` the
    ``max_completion_length``, as TRL's ``_compute_loss`` over one optimizer step:

    - ``grpo``: ``mask / (max(len_i, 1) · N)``: each completion's token mean, then the mean over
      the N completions (an empty one counts in N and adds 0, TRL's ``clamp(min=1.0)``).
    - ``dapo``: ``mask / max(Σ len, 1)``: the update's token mean (TRL: ``num_items_in_batch``,
      the active tokens of the whole generation batch).
    - ``dr_grpo``: ``mask / (N · L)``: the constant normaliser of Dr. GRPO.
    - ``bnpo``: the rows split into ``micro_batches`` equal parts, micro-batch ``m`` holding
      every ``micro_batches``-th row from row ``m`` (rows ``m, m + M, m + 2M, …``: the split of
      the update's gradient accumulation, :func:`minifield.training.train_step.micro_batches`);
      each token weighs ``mask / (max(tokens of m, 1) · micro_batches)``: the token mean of each
      micro-batch, then their mean (TRL: ``loss / mask.sum().clamp(min=1.0)`` per micro-batch,
      divided by the accumulation steps). With one micro-batch it is ``dapo``. TRL shuffles the
      generation batch before splitting it; here the caller orders the rows (the split is fixed,
      so the weights are a pure function of the mask). A micro-batch spans every device of a
      data-parallel update (TRL normalises per process): the device count never changes it.

    ``micro_batches`` is read by ``bnpo`` only (the other normalisers do not depend on the split);
    TRL's grpo and dr_grpo divide each micro-batch by its own size and the step count, which is
    the same as dividing by N when micro-batches are equal, as here.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    mask_NxT = np.asarray(mask_NxT, dtype=np.float64)
    if mask_NxT.ndim != 2:
        raise ValueError(f"mask_NxT must be two-dimensional, got shape {mask_NxT.shape}")
    n = mask_NxT.shape[0]
    len_N = mask_NxT.sum(axis=1)
    if loss_type == "grpo":
        weights_NxT = mask_NxT / (np.maximum(len_N, 1.0)[:, None] * n)
    elif loss_type == "dapo":
        weights_NxT = mask_NxT / max(len_N.sum(), 1.0)
    elif loss_type == "dr_grpo":
        if max_completion_length < 1 or (n and len_N.max() > max_completion_length):
            raise ValueError(
                f"max_completion_length must be at least the longest completion "
                f"({int(len_N.max()) if n else 0} tokens), got {max_completion_length}"
            )
        weights_NxT = mask_NxT / (n * max_completion_length)
    else:
        if micro_batches < 1 or n % micro_batches:
            raise ValueError(
                f"micro_batches must split the {n} completions into equal parts, got {micro_batches}"
            )
        # row i is in micro-batch i mod M (every M-th row, as the update accumulates them)
        tokens_M = len_N.reshape(-1, micro_batches).sum(axis=0)
        per_row_N = np.tile(np.maximum(tokens_M, 1.0) * micro_batches, n // micro_batches)
        weights_NxT = mask_NxT / per_row_N[:, None]
    return weights_NxT.astype(np.float32)
