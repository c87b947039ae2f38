"""A `Batch`'s micro-batches and its log-probs under a model without grad (the old policy's, the reference's):
what both the producer (`grpo.experience`) and the consumer (`grpo.update`) of a batch need from the engine."""
from __future__ import annotations

import torch

from grpo.batch import Batch
from grpo.engine.logprobs import token_logprobs
from grpo.engine.memory import budget_for
from grpo.engine.micro_batches import plan_micro_batches


def plan(batch: Batch, ecfg, model=None):
    """Micro-batches of at most ``ecfg.max_tokens_per_micro_batch`` tokens (an int in a built run, sized when it
    was built; ``auto`` outside one is sized for ``model`` here). ``ecfg``: the run's `EngineConfig` section."""
    return plan_micro_batches([len(p) for p in batch.prompt_ids],
                              [[len(c) for c in g] for g in batch.completion_ids],
                              budget_for(model, ecfg.max_tokens_per_micro_batch, ecfg),
                              shared_prefix=ecfg.shared_prefix)


def most_micro_batches(runtime, n: int) -> int:
    """The most micro-batches any process has (``n`` with one process). Under DeepSpeed ZeRO-2/3 every backward
    (ZeRO-3: every forward too) talks to the other ranks, so a rank with fewer runs idle ones to match."""
    return max(runtime.gather(n))


def idle_forward(model, ecfg, temperature: float) -> None:
    """A one-token forward through the same path as a real micro-batch, for a rank with fewer of them."""
    token_logprobs(model, [[0]], [[[0]]], shared_prefix=ecfg.shared_prefix, temperature=temperature,
                   attention_kernel=ecfg.attention_kernel)


def nested_logprobs(runtime, model, batch: Batch, ecfg, temperature: float) -> list:
    """Log-probs of every completion token under ``model`` (no grad), micro-batched like training; nested like
    ``batch.completion_ids`` (``[group][completion] -> [T]``)."""
    out = [[None] * len(g) for g in batch.completion_ids]
    with torch.no_grad():
        mbs = plan(batch, ecfg, model)
        for _ in range(most_micro_batches(runtime, len(mbs)) - len(mbs)):
            idle_forward(model, ecfg, temperature)
        for mb in mbs:
            lps = token_logprobs(model, [batch.prompt_ids[g] for g, _ in mb],
                                 [batch.completion_ids[g][s] for g, s in mb],
                                 shared_prefix=ecfg.shared_prefix, temperature=temperature,
                                 attention_kernel=ecfg.attention_kernel)
            for (g, s), group_lps in zip(mb, lps):
                for j, lp in zip(range(*s.indices(len(batch.completion_ids[g]))), group_lps):
                    out[g][j] = lp.detach()
    return out
