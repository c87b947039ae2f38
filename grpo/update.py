"""One GRPO batch: the experience a step trains on, and the micro-batched policy update.

`Batch` holds groups laid out group after group; `flat` indices run over every completion in that
order. Every log-prob goes through `grpo.token_logprobs` (the shared-prefix engine).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from grpo.loss import BatchCounts, grpo_loss, pad, token_weights
from grpo.memory import budget_for
from grpo.prefix_engine import plan_micro_batches, token_logprobs
from grpo.rollout_is import MismatchMeter


@dataclass
class Batch:
    rows: list[dict]                          # one dataset row per group
    prompt_ids: list[list[int]]
    completion_ids: list[list[list[int]]]     # [group][completion] -> token ids
    truncated: list[list[bool]]
    rewards: torch.Tensor                     # [N] total reward per completion
    advantages: torch.Tensor                  # [N]
    old_logps: list | None = None             # nested like completion_ids, or None (mu = 1)
    ref_logps: list | None = None             # nested like completion_ids, or None (beta = 0)
    stats: dict = field(default_factory=dict)  # rollout/reward metrics of this batch
    sampling_logps: list | None = None        # the rollout backend's own log-probs (vLLM), nested; None: hf

    @property
    def group_sizes(self) -> list[int]:
        return [len(g) for g in self.completion_ids]

    def flat_index(self, group: int, completion: int) -> int:
        return sum(self.group_sizes[:group]) + completion


def nested_logprobs(model, batch: Batch, ecfg, temperature: float, context=None) -> list:
    """Log-probs of every completion token under ``model`` (no grad), micro-batched like training."""
    out = [[None] * len(g) for g in batch.completion_ids]
    ctx = context if context is not None else contextlib.nullcontext()
    with torch.no_grad(), ctx:
        plan = _plan(batch, ecfg, model)
        for _ in range(_most_micro_batches(len(plan)) - len(plan)):
            _idle_forward(model, ecfg, temperature)
        for mb in plan:
            lps = token_logprobs(model, [batch.prompt_ids[g] for g, _ in mb],
                                 [batch.completion_ids[g][s] for g, s in mb],
                                 shared_prefix=ecfg.shared_prefix, temperature=temperature,
                                 attention_kernel=ecfg.attention_kernel)
            for (g, s), group_lps in zip(mb, lps):
                for j, lp in zip(range(*s.indices(len(batch.completion_ids[g]))), group_lps):
                    out[g][j] = lp.detach()
    return out


def _most_micro_batches(n: int) -> int:
    """The most micro-batches any process has (``n`` with one process). Under DeepSpeed ZeRO-2/3 every backward
    (ZeRO-3: every forward too) talks to the other ranks, so a rank with fewer runs idle ones to match."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return n
    counts = [None] * dist.get_world_size()
    dist.all_gather_object(counts, n)
    return max(counts)


def _idle_forward(model, ecfg, temperature: float) -> None:
    """A one-token forward through the same path as a real micro-batch, for a rank with fewer of them."""
    token_logprobs(model, [[0]], [[[0]]], shared_prefix=ecfg.shared_prefix, temperature=temperature,
                   attention_kernel=ecfg.attention_kernel)


def _plan(batch: Batch, ecfg, model=None):
    """Micro-batches of at most engine.max_tokens_per_micro_batch tokens (resolved by grpo.memory.plan when the run
    was built; ``auto`` outside a built run is sized for ``model`` here)."""
    return plan_micro_batches([len(p) for p in batch.prompt_ids],
                              [[len(c) for c in g] for g in batch.completion_ids],
                              budget_for(model, ecfg.max_tokens_per_micro_batch, ecfg),
                              shared_prefix=ecfg.shared_prefix)


def loss_mask(batch: Batch, mask_truncated: bool) -> list[bool]:
    """Which completions contribute to the loss (flat order)."""
    return [not (mask_truncated and t) for flags in batch.truncated for t in flags]


def batch_counts(batch: Batch, keep: list[bool], max_len: int, runtime) -> BatchCounts:
    """Batch-wide denominators, summed over every process."""
    lengths = [len(c) for g in batch.completion_ids for c in g]
    seqs = sum(keep)
    tokens = sum(n for n, k in zip(lengths, keep) if k)
    seqs, tokens = runtime.all_reduce_sum([float(seqs), float(tokens)])
    return BatchCounts(num_seqs=int(seqs), num_tokens=int(tokens), max_len=max_len)


def policy_update(runtime, batch: Batch, acfg, ecfg, *, temperature: float, max_len: int,
                  mask_truncated: bool, max_grad_norm: float) -> dict:
    """Forward/backward every micro-batch (loss normalised batch-wide), then one optimizer step.

    A batch with no completion left to learn from on any rank (every group filtered out, or every
    completion truncated with mask_truncated) is skipped: no forward, no optimizer or scheduler step,
    ``skipped`` and ``empty_batch`` true."""
    model = runtime.model
    keep = loss_mask(batch, mask_truncated)
    counts = batch_counts(batch, keep, max_len, runtime)
    if counts.num_seqs == 0:  # nothing to learn from on any rank (all filtered or masked): no forward, no step
        return {"loss": None, "grad_norm": 0.0, "skipped": True, "empty_batch": True, "entropy": None,
                "clip_ratio_low": None, "clip_ratio_high": None, "clip_ratio": None, "ratio_mean": None, "kl": None}
    totals: dict[str, float] = {}
    loss_total, entropy_sum = 0.0, 0.0
    plan = _plan(batch, ecfg, model)
    n_micro = _most_micro_batches(len(plan))
    meter = MismatchMeter(acfg.rollout_is, acfg.rollout_is_cap) if batch.sampling_logps is not None else None
    if hasattr(runtime, "expect_backwards"):  # DeepSpeed: the last backward closes the accumulation
        runtime.expect_backwards(n_micro)
    for mb in plan + [None] * (n_micro - len(plan)):
        if mb is None:  # idle: another rank has more micro-batches; one token, weight 0, same code path
            prompts, comps, flat = [[0]], [[[0]]], []
        else:
            prompts = [batch.prompt_ids[g] for g, _ in mb]
            comps = [batch.completion_ids[g][s] for g, s in mb]
            flat = [batch.flat_index(g, j) for g, s in mb for j in range(*s.indices(len(batch.completion_ids[g])))]
        logps, ents = token_logprobs(model, prompts, comps, shared_prefix=ecfg.shared_prefix,
                                     temperature=temperature, return_entropy=True,
                                     attention_kernel=ecfg.attention_kernel)
        lp, mask = pad([t for group in logps for t in group])
        mask = mask * torch.tensor([float(keep[i]) for i in flat] if mb else [0.0], device=mask.device)[:, None]
        old = _gather(batch.old_logps, batch, flat, lp) if batch.old_logps is not None and mb else None
        ref = None if batch.ref_logps is None else _gather(batch.ref_logps, batch, flat, lp) if mb else lp.detach()
        adv = batch.advantages[flat].to(lp.device) if mb else torch.zeros(1, device=lp.device)
        # the sampler's log-probs differ from pi_old's (vLLM): re-weight each token by pi_old / pi_sampler
        is_w = meter.weights(old if old is not None else lp, _gather(batch.sampling_logps, batch, flat, lp), mask) \
            if meter is not None and mb else None
        loss, stats = grpo_loss(lp, old, ref, adv, mask, token_weights(mask, acfg.loss_agg, counts),
                                beta=0.0 if acfg.kl_in_reward else acfg.beta, epsilon=acfg.epsilon,
                                epsilon_high=acfg.epsilon_high, delta=acfg.delta,
                                kl_estimator=acfg.kl_estimator, importance_sampling=acfg.importance_sampling,
                                rollout_weights=is_w)
        runtime.backward(loss)
        loss_total += float(loss.detach())
        ent, _ = pad([t.detach() for group in ents for t in group])
        entropy_sum += float((ent * mask).sum())
        for k, v in stats.items():
            totals[k] = totals.get(k, 0.0) + float(v)
    grad_norm, stepped = runtime.step(max_grad_norm)
    keys = sorted(totals)
    summed = runtime.all_reduce_sum([loss_total, entropy_sum] + [totals[k] for k in keys])
    loss_total, entropy_sum, totals = summed[0], summed[1], dict(zip(keys, summed[2:]))
    tokens = max(totals.get("tokens", 0.0), 1.0)
    out = {"loss": loss_total, "grad_norm": grad_norm, "skipped": not stepped, "empty_batch": False,
           "entropy": entropy_sum / tokens, "clip_ratio_low": totals["clip_low"] / tokens,
           "clip_ratio_high": totals["clip_high"] / tokens,
           "clip_ratio": (totals["clip_low"] + totals["clip_high"]) / tokens,
           "ratio_mean": totals["ratio"] / tokens}
    if "kl" in totals:
        out["kl"] = totals["kl"] / tokens
    if meter is not None:
        out.update(meter.metrics(runtime))
    return out


def _gather(nested: list, batch: Batch, flat: list[int], like: torch.Tensor) -> torch.Tensor:
    seqs = [t for group in nested for t in group]
    padded, _ = pad([seqs[i].to(like.device) for i in flat])
    return padded
