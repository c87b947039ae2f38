"""The GRPO objective per token: a registered policy loss (`grpo.algorithm.policy_loss`), the rollout correction's
weights on it, plus a KL penalty to the reference (`grpo.algorithm.kl`), aggregated by batch-wide token weights
(`grpo.algorithm.aggregation`).

All functions are pure and work on right-padded ``[B, T]`` tensors with a 0/1 ``mask``.
"""
from __future__ import annotations

import torch

from grpo.algorithm.aggregation import BatchCounts, token_weights
from grpo.algorithm.kl import kl_estimate
from grpo.algorithm.policy_loss import PolicyLoss, get_policy_loss
from grpo.config.schema import AlgorithmConfig

__all__ = ["BatchCounts", "grpo_loss", "kl_estimate", "objective", "pad", "token_weights"]


def objective(logp, old_logp, ref_logp, advantages, mask, weights, algorithm: AlgorithmConfig,
              rollout_weights=None, policy_loss: PolicyLoss | None = None):
    """Returns ``(loss, stats)``: the weighted loss of this (micro-)batch and token-summed statistics.

    Args:
        logp, old_logp, ref_logp, mask, weights: ``[B, T]``. ``old_logp=None``: one inner iteration (old =
            logp.detach(), ratio 1); ``ref_logp=None`` or a zero KL coefficient skips the KL.
        advantages: ``[B]``.
        algorithm: the run's `AlgorithmConfig`: ``policy_loss`` and its hyperparameters, ``kl_estimator``, ``beta``
            (the KL penalty's coefficient; none here with ``kl_in_reward``: the KL is then in the reward).
        rollout_weights: ``[B, T]`` or None, no gradient: the rollout importance-sampling weights
            (`grpo.algorithm.rollout_is`) that multiply the policy term of every token, not the KL penalty.
        policy_loss: the loss ``algorithm.policy_loss`` names, resolved once per run (`get_policy_loss`); None
            resolves it here.

    Returns:
        ``(loss, stats)``: stats are sums over masked tokens (divide by ``stats["tokens"]`` for means).
    """
    mask = mask.float()
    old_logp = logp.detach() if old_logp is None else old_logp
    policy_loss = policy_loss or get_policy_loss(algorithm.policy_loss)
    per_token, policy_stats = policy_loss(logp, old_logp, advantages, mask, algorithm)
    if rollout_weights is not None:
        per_token = per_token * rollout_weights
    stats = {"tokens": mask.sum()}
    beta = 0.0 if algorithm.kl_in_reward else algorithm.beta
    if beta > 0 and ref_logp is not None:
        kl = kl_estimate(logp, ref_logp, algorithm.kl_estimator)                        # [B, T]
        per_token = per_token + beta * kl
        stats["kl"] = (kl.detach() * mask).sum()
    loss = (per_token * weights).sum()
    return loss, {**stats, **policy_stats}


def grpo_loss(logp, old_logp, ref_logp, advantages, mask, weights, *, beta: float = 0.0, rollout_weights=None,
              **algorithm):
    """`objective` with the algorithm's keys as keyword arguments (``epsilon``, ``epsilon_high``, ``delta``,
    ``kl_estimator``, ``importance_sampling``, ``policy_loss``; the others as `AlgorithmConfig`'s defaults)."""
    if "kl_coef" in algorithm:  # the KL coefficient has one name
        raise TypeError("grpo_loss() takes no kl_coef: the KL penalty's coefficient is beta (algorithm.beta)")
    return objective(logp, old_logp, ref_logp, advantages, mask, weights, AlgorithmConfig(beta=beta, **algorithm),
                     rollout_weights)


def pad(seqs: list[torch.Tensor], value: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad 1-D tensors to ``[B, T]``; returns (padded, mask)."""
    from torch.nn.utils.rnn import pad_sequence

    padded = pad_sequence(seqs, batch_first=True, padding_value=value)
    lengths = torch.tensor([s.numel() for s in seqs], device=padded.device)
    mask = (torch.arange(padded.shape[1], device=padded.device) < lengths[:, None]).float()
    return padded, mask
