"""The micro-batched policy update: forward/backward every micro-batch of a `Batch`, then one optimizer step.

Every log-prob goes through `grpo.token_logprobs` (the shared-prefix engine); every collective through
the runtime.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from grpo.algorithm.aggregation import BatchCounts, token_weights
from grpo.algorithm.loss import objective, pad
from grpo.algorithm.rollout_is import MismatchMeter
from grpo.batch import Batch
from grpo.config.schema import AlgorithmConfig, EngineConfig
from grpo.engine import token_logprobs
from grpo.engine.batch_logprobs import most_micro_batches, plan
from grpo.runtime.base import Runtime


@dataclass(frozen=True)
class UpdateSettings:
    """What `policy_update` needs, derived once per run (`grpo.trainer.settings.derive`)."""
    algorithm: AlgorithmConfig
    engine: EngineConfig       # its max_tokens_per_micro_batch an int in a built run (sized when it was built)
    temperature: float         # rollout.temperature: log-probs of softmax(logits / T), as sampled
    max_len: int               # dr_grpo's constant normaliser: the most tokens the policy samples per completion
    mask_truncated: bool       # truncated completions contribute no loss
    max_grad_norm: float       # clip to this norm (0 = no clipping)
    rollout_is: str = "token_truncate"  # algorithm.rollout_is: the correction for a sampler's own log-probs (vLLM)
    rollout_is_cap: float = 2.0         # algorithm.rollout_is_cap
    policy_loss: Callable | None = None  # the loss algorithm.policy_loss names, resolved once (None: at each call)


def loss_mask(batch: Batch, mask_truncated: bool) -> list[bool]:
    """Which completions contribute to the loss (flat order)."""
    return [not (mask_truncated and t) for flags in batch.truncated for t in flags]


def batch_counts(batch: Batch, keep: list[bool], max_len: int, runtime: Runtime) -> BatchCounts:
    """Batch-wide denominators, summed over every process."""
    lengths = [batch.sampled_count(g, j) for g in range(len(batch.completion_ids))
               for j in range(len(batch.completion_ids[g]))]  # tool/environment tokens are not counted
    seqs = sum(keep)
    tokens = sum(n for n, k in zip(lengths, keep) if k)
    total = runtime.all_reduce({"seqs": float(seqs), "tokens": float(tokens)})
    return BatchCounts(num_seqs=int(total["seqs"]), num_tokens=int(total["tokens"]), max_len=max_len)


EMPTY = {"loss": None, "grad_norm": 0.0, "skipped": True, "empty_batch": True, "entropy": None,
         "clip_ratio_low": None, "clip_ratio_high": None, "clip_ratio": None, "ratio_mean": None, "kl": None}


def policy_update(runtime: Runtime, batch: Batch, settings: UpdateSettings) -> dict:
    """Forward/backward every micro-batch (loss normalised batch-wide), then one optimizer step.

    A batch with no completion left to learn from on any rank (every group filtered out, or every
    completion truncated with mask_truncated) is skipped: no forward, no optimizer or scheduler step,
    ``skipped`` and ``empty_batch`` true."""
    keep = loss_mask(batch, settings.mask_truncated)
    counts = batch_counts(batch, keep, settings.max_len, runtime)
    if counts.num_seqs == 0:  # nothing to learn from on any rank (all filtered or masked): no forward, no step
        return dict(EMPTY)
    totals: dict[str, float] = {}  # every micro-batch (idle ones too) reports loss, entropy and tokens
    mbs = plan(batch, settings.engine, runtime.model)
    n_micro = most_micro_batches(runtime, len(mbs))
    # a sampler with its own log-probs (vLLM): each token re-weighted by pi_old / pi_sampler (grpo.algorithm.rollout_is)
    meter = MismatchMeter(settings.rollout_is, settings.rollout_is_cap) if batch.sampling_logps is not None else None
    runtime.expect_backwards(n_micro)  # DeepSpeed: the last backward closes the accumulation
    for mb in mbs + [None] * (n_micro - len(mbs)):  # None: idle, another rank has more micro-batches
        for k, v in _micro_batch(runtime, batch, mb, keep, counts, settings, meter).items():
            totals[k] = totals.get(k, 0.0) + v
    grad_norm, stepped = runtime.step(settings.max_grad_norm)
    totals = runtime.all_reduce({**totals, **(meter.sums if meter is not None else {})})
    tokens = max(totals.get("tokens", 0.0), 1.0)
    mean = lambda *keys: sum(totals[k] for k in keys) / tokens if all(k in totals for k in keys) else None  # noqa
    out = {"loss": totals["loss"], "grad_norm": grad_norm, "skipped": not stepped, "empty_batch": False,
           "entropy": totals["entropy"] / tokens, "clip_ratio_low": mean("clip_low"),
           "clip_ratio_high": mean("clip_high"), "clip_ratio": mean("clip_low", "clip_high"),
           "ratio_mean": mean("ratio")}  # None: a policy loss that does not clip or report its ratio
    if "kl" in totals:
        out["kl"] = totals["kl"] / tokens
    if meter is not None:
        out.update(meter.metrics(runtime, totals))
    return out


def _micro_batch(runtime: Runtime, batch: Batch, mb, keep: list[bool], counts: BatchCounts,
                 settings: UpdateSettings, meter: MismatchMeter | None = None) -> dict[str, float]:
    """Forward and backward of one micro-batch (``mb`` None: one idle token, weight 0, the same code path);
    returns its sums: loss, entropy and grpo_loss's statistics. ``meter``: the rollout importance-sampling
    correction (batches with the sampler's own log-probs), which also records the mismatch."""
    acfg, ecfg = settings.algorithm, settings.engine
    if mb is None:
        prompts, comps, flat = [[0]], [[[0]]], []
    else:
        prompts = [batch.prompt_ids[g] for g, _ in mb]
        comps = [batch.completion_ids[g][s] for g, s in mb]
        flat = [batch.flat_index(g, j) for g, s in mb for j in range(*s.indices(len(batch.completion_ids[g])))]
    logps, ents = token_logprobs(runtime.model, prompts, comps, shared_prefix=ecfg.shared_prefix,
                                 temperature=settings.temperature, return_entropy=True,
                                 attention_kernel=ecfg.attention_kernel)
    lp, mask = pad([t for group in logps for t in group])
    mask = mask * torch.tensor([float(keep[i]) for i in flat] if mb else [0.0], device=mask.device)[:, None]
    if batch.completion_masks is not None and mb:  # tool/environment tokens: in the input, out of the loss
        mask = mask * pad([batch.token_mask(g, j) for g, s in mb
                           for j in range(*s.indices(len(batch.completion_ids[g])))])[0].to(mask.device)
    old = _gather(batch.old_logps, flat, lp) if batch.old_logps is not None and mb else None
    ref = None if batch.ref_logps is None else _gather(batch.ref_logps, flat, lp) if mb else lp.detach()
    adv = batch.advantages[flat].to(lp.device) if mb else torch.zeros(1, device=lp.device)
    is_w = meter.weights(old if old is not None else lp, _gather(batch.sampling_logps, flat, lp), mask) \
        if meter is not None and mb else None
    loss, stats = objective(lp, old, ref, adv, mask, token_weights(mask, acfg.loss_agg, counts), acfg,
                            rollout_weights=is_w, policy_loss=settings.policy_loss)
    runtime.backward(loss)
    ent, _ = pad([t.detach() for group in ents for t in group])
    return {"loss": float(loss.detach()), "entropy": float((ent * mask).sum()),
            **{k: float(v) for k, v in stats.items()}}


def _gather(nested: list, flat: list[int], like: torch.Tensor) -> torch.Tensor:
    seqs = [t for group in nested for t in group]
    padded, _ = pad([seqs[i].to(like.device) for i in flat])
    return padded
