"""How per-token losses become one number: per-token weights computed from *batch-wide* counts, so that summing
the loss of micro-batches gives exactly the full-batch loss (gradient accumulation does not change which
aggregation is computed)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BatchCounts:
    """Batch-wide counts that fix the aggregation's denominators (over *all* micro-batches and ranks)."""

    num_seqs: int
    num_tokens: int
    max_len: int  # constant length for dr_grpo (rollout.max_new_tokens)


def token_weights(mask: torch.Tensor, agg: str, counts: BatchCounts) -> torch.Tensor:
    """Weight ``[B, T]`` of every token so that ``(per_token_loss * weights).sum()`` is the aggregated loss.

    token_mean:            sum over all tokens / total tokens   (DAPO's token-level loss, arXiv:2503.14476 sec. 3.3)
    seq_mean_token_mean:   mean over sequences of each sequence's token mean       (GRPO, arXiv:2402.03300 eq. 3)
    seq_mean_token_sum:    mean over sequences of each sequence's token sum
    dr_grpo:               sum over all tokens / (num sequences * constant max length)
                           (Dr. GRPO, arXiv:2503.20783: no per-sequence length normalisation)
    """
    mask = mask.float()
    if agg == "token_mean":
        return mask / max(counts.num_tokens, 1)
    if agg == "seq_mean_token_mean":
        lengths = mask.sum(-1, keepdim=True).clamp(min=1)  # [B, 1]
        return mask / lengths / max(counts.num_seqs, 1)
    if agg == "seq_mean_token_sum":
        return mask / max(counts.num_seqs, 1)
    if agg == "dr_grpo":
        return mask / (max(counts.num_seqs, 1) * counts.max_len)
    raise ValueError(f"loss_agg must be token_mean, seq_mean_token_mean, seq_mean_token_sum or dr_grpo, got {agg!r}")
