"""Multi-turn episodes inside `collect` and the update's normaliser: the KL that collect measures covers only the
tokens the policy sampled (environment tokens carry none), and Dr. GRPO's constant is the most tokens the policy
samples in an episode (max_new_tokens per turn), not the longest completion with tool output in it."""
from __future__ import annotations

import pytest
import torch

from grpo.algorithm.loss import kl_estimate
from grpo.rollout.episodes.spec import max_completion_tokens

ECHO = {"rollout": {"environment": "tests.tool_fixtures:Echo", "max_turns": 3, "max_new_tokens": 4,
                    "max_tool_tokens": 16},
        "data": {"num_eval": 0}, "logging": {"sample_every": 0, "plot": False}}


def test_collect_measures_the_kl_over_sampled_tokens_only(cfg_factory):
    from omegaconf import OmegaConf

    from grpo import experience
    from grpo.trainer.build import build_run

    cfg = cfg_factory(OmegaConf.merge(ECHO, {"algorithm": {"beta": 0.1, "num_iterations": 2}}))
    run = build_run(cfg)
    try:
        with torch.no_grad():  # a reference that differs from the policy: a KL on every token, tool tokens too
            gen = torch.Generator().manual_seed(0)
            for p in run.reference.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
        batch = experience.collect(run.sampler, run.runtime, run.settings.collect, run)
    finally:
        run.close()
    masks = [torch.tensor(m, dtype=torch.float32) for g in batch.completion_masks for m in g]
    assert any(float(m.min()) == 0.0 for m in masks)  # the observations are in the completions
    kl = [kl_estimate(lp, ref, cfg.algorithm.kl_estimator) for go, gr in zip(batch.old_logps, batch.ref_logps)
          for lp, ref in zip(go, gr)]
    sampled = sum(float((k * m).sum()) for k, m in zip(kl, masks)) / sum(float(m.sum()) for m in masks)
    every = sum(float(k.sum()) for k in kl) / sum(len(k) for k in kl)
    assert batch.stats["kl"] == pytest.approx(sampled, rel=1e-5)
    assert abs(sampled - every) > 1e-3 * sampled  # the two differ: the test can tell them apart


def test_dr_grpo_constant_counts_sampled_tokens_not_tool_output(cfg_factory):
    from omegaconf import OmegaConf

    from grpo.algorithm.loss import token_weights
    from grpo.batch import Batch
    from grpo.runtime.base import Runtime
    from grpo.trainer.settings import derive
    from grpo.update import batch_counts

    cfg = cfg_factory(OmegaConf.merge(ECHO, {"algorithm": {"loss_agg": "dr_grpo"}}))
    settings = derive(cfg).update
    assert settings.max_len == 4 * 3  # max_new_tokens per turn, max_turns turns
    assert max_completion_tokens(cfg.rollout) > settings.max_len  # what it must not be: tool tokens included
    single = cfg_factory({"rollout": {"max_new_tokens": 7}})
    assert derive(single).update.max_len == 7
    # the weights: mask / (sequences * constant); the counts' tokens are the sampled ones
    batch = Batch([{}], [[5, 6]], [[[7, 8, 9, 10], [11, 12]]], [[False, False]], torch.zeros(2), torch.zeros(2),
                  completion_masks=[[[1, 0, 0, 1], [1, 1]]])
    counts = batch_counts(batch, [True, True], settings.max_len, Runtime())
    assert (counts.num_seqs, counts.num_tokens, counts.max_len) == (2, 4, 12)
    mask = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    assert torch.equal(token_weights(mask, "dr_grpo", counts), mask / (2 * 12))


def test_collect_seeds_every_turn_and_hands_the_episodes_to_the_rewards_and_the_batch(cfg_factory, monkeypatch):
    """A seeded backend gets the step's seed on the first turn and a seed of its own on every later one (a resumed
    run samples each turn as the uninterrupted one did); the reward functions get the episode columns, the batch
    the episodes."""
    from grpo import experience
    from grpo.rollout.backends import step_seed
    from grpo.trainer.build import build_run

    run = build_run(cfg_factory(ECHO))
    seeds, columns = [], {}
    real_score = experience.score
    monkeypatch.setattr(experience, "score", lambda f, p, c, cols: columns.update(cols) or real_score(f, p, c, cols))
    try:
        backend = run.sampler.backend.ready()  # built on first use; collect gets this one
        run.sampler.seeded, real = True, backend.generate  # as a backend with its own generator, or ahead
        backend.generate = lambda ids, g, sampling, seed=None, **kw: seeds.append(seed) or real(ids, g, sampling,
                                                                                                seed=seed, **kw)
        batch = experience.collect(run.sampler, run.runtime, run.settings.collect, run)
        base = (run.settings.collect.seed, 0, run.sampler.prompts.epoch, run.sampler.prompts.position)
        logged = experience.sampling_stats(run.runtime, batch.sums)
    finally:
        run.close()
    assert len(seeds) >= 2 and seeds == [step_seed(*base)] + [step_seed(*base, t) for t in range(2, len(seeds) + 1)]
    assert {"turns", "tool_calls", "episode"} <= set(columns) and len(columns["turns"]) == len(columns["truncated"])
    assert batch.episodes is not None and len(batch.episodes) == len(batch.completion_ids)
    assert {"score", "episode"} <= set(batch.sums) and logged["episode/turns_mean"] >= 1  # the episodes are logged
