"""The GRPO objective: PPO-style clipped ratio plus a KL penalty to the reference, per token.

All functions are pure and work on right-padded ``[B, T]`` tensors with a 0/1 ``mask``. The
aggregation over tokens is expressed as per-token weights computed from *batch-wide* counts, so
summing the loss of micro-batches gives exactly the full-batch loss (gradient accumulation does not
change which aggregation is computed).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman's k1/k2/k3)."""
    log_ratio = ref_logp - logp  # log pi_ref / pi
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio ** 2
    if estimator == "k3":
        return torch.exp(log_ratio) - log_ratio - 1
    raise ValueError(f"kl_estimator must be k1, k2 or k3, got {estimator!r}")


@dataclass(frozen=True)
class BatchCounts:
    """Batch-wide counts that fix the aggregation's denominators (over *all* micro-batches)."""

    num_seqs: int
    num_tokens: int
    max_len: int  # constant length for dr_grpo (rollout.max_new_tokens)


def token_weights(mask: torch.Tensor, agg: str, counts: BatchCounts) -> torch.Tensor:
    """Weight of every token so that ``(per_token_loss * weights).sum()`` is the aggregated loss.

    token_mean:            sum over all tokens / total tokens                      (DAPO)
    seq_mean_token_mean:   mean over sequences of each sequence's token mean       (GRPO paper)
    seq_mean_token_sum:    mean over sequences of each sequence's token sum
    dr_grpo:               sum over all tokens / (num sequences * constant max length)  (Dr. GRPO)
    """
    mask = mask.float()
    if agg == "token_mean":
        return mask / max(counts.num_tokens, 1)
    if agg == "seq_mean_token_mean":
        lengths = mask.sum(-1, keepdim=True).clamp(min=1)
        return mask / lengths / max(counts.num_seqs, 1)
    if agg == "seq_mean_token_sum":
        return mask / max(counts.num_seqs, 1)
    if agg == "dr_grpo":
        return mask / (max(counts.num_seqs, 1) * counts.max_len)
    raise ValueError(f"loss_agg must be token_mean, seq_mean_token_mean, seq_mean_token_sum or dr_grpo, got {agg!r}")


def importance_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor,
                     level: str = "token") -> torch.Tensor:
    """rho = pi / pi_old per token, or GSPO's length-normalised sequence ratio broadcast to tokens."""
    log_ratio = logp - old_logp
    if level == "token":
        return torch.exp(log_ratio)
    if level == "sequence":
        seq = (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
        return torch.exp(seq).expand_as(logp)
    raise ValueError(f"importance_sampling must be token or sequence, got {level!r}")


def grpo_loss(logp, old_logp, ref_logp, advantages, mask, weights, *, beta: float = 0.0,
              epsilon: float = 0.2, epsilon_high: float | None = None, delta: float | None = None,
              kl_estimator: str = "k3", importance_sampling: str = "token", rollout_weights=None):
    """Returns ``(loss, stats)``: the weighted loss of this (micro-)batch and token-summed statistics.

    logp, old_logp, ref_logp, mask, weights: ``[B, T]``; advantages: ``[B]``. ``old_logp=None`` means
    one inner iteration (old = logp.detach(), ratio 1); ``ref_logp=None`` or ``beta=0`` skips the KL.
    stats are sums over masked tokens (divide by ``stats["tokens"]`` for means). ``rollout_weights`` ``[B, T]``
    (optional, no gradient): the rollout importance-sampling weights (`grpo.algorithm.rollout_is`) that multiply the
    policy term of every token, not the KL penalty.
    """
    mask = mask.float()
    old_logp = logp.detach() if old_logp is None else old_logp
    eps_high = epsilon if epsilon_high is None else epsilon_high
    adv = advantages.unsqueeze(-1)
    ratio = importance_ratio(logp, old_logp, mask, importance_sampling)
    capped = torch.clamp(ratio, max=delta) if delta is not None else ratio
    unclipped = capped * adv
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + eps_high) * adv
    per_token = -torch.min(unclipped, clipped)
    if rollout_weights is not None:
        per_token = per_token * rollout_weights
    stats = {"tokens": mask.sum()}
    if beta > 0 and ref_logp is not None:
        kl = kl_estimate(logp, ref_logp, kl_estimator)
        per_token = per_token + beta * kl
        stats["kl"] = (kl.detach() * mask).sum()
    loss = (per_token * weights).sum()
    with torch.no_grad():
        low = (ratio < 1 - epsilon) & (adv < 0)
        high = (ratio > 1 + eps_high) & (adv > 0)
        stats["clip_low"] = (low.float() * mask).sum()
        stats["clip_high"] = (high.float() * mask).sum()
        stats["ratio"] = (ratio.detach() * mask).sum()
    return loss, stats


def pad(seqs: list[torch.Tensor], value: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad 1-D tensors to ``[B, T]``; returns (padded, mask)."""
    from torch.nn.utils.rnn import pad_sequence

    padded = pad_sequence(seqs, batch_first=True, padding_value=value)
    lengths = torch.tensor([s.numel() for s in seqs], device=padded.device)
    mask = (torch.arange(padded.shape[1], device=padded.device) < lengths[:, None]).float()
    return padded, mask
