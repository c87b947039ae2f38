"""Every `algorithm` switch end to end (docs/algorithms.md).

Pure pieces are checked on hand-computed batches; the switches that live in the loop (filtering and
resampling, several passes per batch, truncation masking, where the KL goes, GSPO) run the real
`grpo.train.train` on the smoke recipe (tiny Llama, a few steps) or the real `policy_update` on a fixed
batch with the optimizer step replaced by a gradient capture.
"""
from __future__ import annotations

import dataclasses
import json
import math
from types import SimpleNamespace

import pytest
import torch

from grpo.advantages import compute_advantages
from grpo.loss import BatchCounts, grpo_loss, pad, token_weights

FAST = {"data": {"num_eval": 0}, "logging": {"sample_every": 0, "plot": False}, "rollout": {"max_new_tokens": 8}}


def _merge(*dicts):
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.merge(*[OmegaConf.create(d) for d in dicts]))


def _rows(cfg):
    from pathlib import Path

    path = Path(cfg.trainer.output_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if '"loss"' in line]


def _params(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture
def spy(monkeypatch):
    """Wraps train(): keeps the Run, counts rollouts and log-prob passes, snapshots the initial weights."""
    import grpo.experience
    import grpo.train

    s = SimpleNamespace(run=None, initial=None, rollouts=0, logprob_passes=0, scores=[])
    build = grpo.train.build_run

    def build_run(cfg):
        s.run = build(cfg)
        s.initial = _params(s.run.policy)
        return s.run

    gen, nested, score = grpo.experience.generate, grpo.experience.nested_logprobs, grpo.experience.score_groups

    def generate(*a, **k):
        s.rollouts += 1
        return gen(*a, **k)

    def nested_logprobs(*a, **k):
        s.logprob_passes += 1
        return nested(*a, **k)

    def score_groups(*a, **k):
        rewards, stats = score(*a, **k)
        s.scores.append(rewards.clone())
        return rewards, stats

    monkeypatch.setattr(grpo.train, "build_run", build_run)
    monkeypatch.setattr(grpo.experience, "generate", generate)
    monkeypatch.setattr(grpo.experience, "nested_logprobs", nested_logprobs)
    monkeypatch.setattr(grpo.experience, "score_groups", score_groups)
    return s


def _train(cfg_factory, *overrides):
    from grpo.train import train

    cfg = cfg_factory(_merge(FAST, *overrides))
    train(cfg)
    return cfg, _rows(cfg)


def scheduled_reward(schedule: list[list[bool]], group_size: int):
    """A reward function whose n-th call gives group g a spread (0,1,0,1,..) if schedule[n][g] else all 0."""
    calls = {"n": 0}

    def fn(prompts, completions, **kwargs):
        signal = schedule[min(calls["n"], len(schedule) - 1)]
        calls["n"] += 1
        return [float(i % 2) if signal[i // group_size] else 0.0 for i in range(len(completions))]

    return fn


def _use_reward(monkeypatch, fn):
    import grpo.setup
    from grpo.rewards.score import RewardFunction

    monkeypatch.setattr(grpo.setup, "build_rewards", lambda spec, *args: [RewardFunction("accuracy", fn)])


# --------------------------------------------------------------------------------- pure functions
def test_empty_and_cross_rank_batch_advantages():
    for scale in ("group", "batch", "none"):
        assert compute_advantages(torch.zeros(0), [], scale).numel() == 0
    r = torch.tensor([1.0, 3.0, 0.0, 4.0])
    # scale_rewards=batch with several ranks: the std of the whole batch is passed in
    assert torch.allclose(compute_advantages(r, [2, 2], "batch", eps=0.0, batch_std=2.0),
                          torch.tensor([-0.5, 0.5, -1.0, 1.0]))


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimator_in_the_loss_hand_computed(estimator):
    logp = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0], [-0.5, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv = torch.tensor([0.5, -0.5])
    w = token_weights(mask, "token_mean", BatchCounts(2, 3, 2))
    loss, stats = grpo_loss(logp, None, ref, adv, mask, w, beta=0.2, kl_estimator=estimator)
    d = [(-1.5 + 1.0), (-1.0 + 2.0), 0.0]  # log pi_ref/pi on the three real tokens
    kl = {"k1": [-x for x in d], "k2": [0.5 * x * x for x in d], "k3": [math.exp(x) - x - 1 for x in d]}[estimator]
    pg = -(0.5 + 0.5 - 0.5) / 3   # ratio 1: -(sum of token advantages) / tokens
    assert loss.item() == pytest.approx(pg + 0.2 * sum(kl) / 3, rel=1e-6)
    assert stats["kl"].item() == pytest.approx(sum(kl), rel=1e-6)


def test_gspo_sequence_ratio_loss_and_gradient_hand_computed():
    # seq 0: mean log-ratio 0.1 -> s = e^0.1 (inside [0.8, 1.2]); seq 1: mean 0.5 -> s = e^0.5, clipped (A > 0)
    logp = torch.tensor([[0.2, 0.0, 0.0], [0.5, 0.5, 0.5]], requires_grad=True)
    old = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    adv = torch.tensor([-1.0, 2.0])
    w = token_weights(mask, "seq_mean_token_mean", BatchCounts(2, 5, 3))
    loss, stats = grpo_loss(logp, old, None, adv, mask, w, epsilon=0.2, importance_sampling="sequence")
    s0, s1 = math.exp(0.1), math.exp(0.5)
    expected = 0.5 * (-min(s0 * -1.0, 1.0 * -1.0 * s0)) + 0.5 * (-min(s1 * 2.0, 1.2 * 2.0))
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert stats["clip_high"].item() == 3 and stats["clip_low"].item() == 0  # every token of seq 1
    assert stats["ratio"].item() == pytest.approx(2 * s0 + 3 * s1, rel=1e-6)
    loss.backward()
    # seq 0: d/dlogp_t of 0.5 * s0 * 1 with s0 = exp(mean over 2 tokens) -> 0.5 * s0 / 2 on each real token
    assert torch.allclose(logp.grad[0], torch.tensor([0.25 * s0, 0.25 * s0, 0.0]))
    assert torch.equal(logp.grad[1], torch.zeros(3))  # clipped: no gradient


def test_resample_needs_filtering(cfg_factory):
    from grpo.config import ConfigError

    with pytest.raises(ConfigError, match="resample_zero_std=2 needs algorithm.filter_zero_std_groups=true"):
        cfg_factory({"algorithm": {"resample_zero_std": 2}})
    with pytest.raises(ConfigError, match="resample_zero_std=-1 is out of range"):
        cfg_factory({"algorithm": {"resample_zero_std": -1, "filter_zero_std_groups": True}})


# ----------------------------------------------------------------- policy_update on a fixed batch
@pytest.fixture(scope="module")
def fixed(tmp_path_factory):
    """A built run (tiny Llama) and a fixed batch of 3 prompts x 4 random completions of ragged lengths."""
    from omegaconf import OmegaConf

    from grpo.config import load
    from grpo.setup import build_run
    from grpo.update import Batch
    from tests.helpers import smoke_raw

    raw = OmegaConf.merge(smoke_raw(), FAST, {"trainer": {"output_dir": str(tmp_path_factory.mktemp("run"))},
                                              "algorithm": {"beta": 0.0}})
    cfg = load(OmegaConf.to_container(raw, resolve=True))
    run = build_run(cfg)
    gen = torch.Generator().manual_seed(0)
    rows = run.splits.train[:3]
    comps = [[torch.randint(3, len(run.tokenizer), (int(n),), generator=gen).tolist()
              for n in torch.randint(2, 9, (4,), generator=gen)] for _ in rows]
    rewards = torch.rand(12, generator=gen)
    batch = Batch(rows, [r["prompt_ids"] for r in rows], comps, [[False, True, False, True] for _ in rows], rewards,
                  compute_advantages(rewards, [4, 4, 4]))
    return run, cfg, batch


def _capture_grads(monkeypatch, run) -> list:
    """Replace the optimizer step by a capture of the gradients (weights stay put)."""
    grads = []

    def step(max_grad_norm):
        grads.append({n: p.grad.clone() for n, p in run.model.named_parameters() if p.grad is not None})
        run.optimizer.zero_grad(set_to_none=True)
        return 0.0, True

    monkeypatch.setattr(run.runtime, "step", step)
    return grads


def _update(run, cfg, batch, acfg=None, ecfg=None, mask_truncated=False):
    from grpo.update import policy_update

    return policy_update(run.runtime, batch, acfg or cfg.algorithm, ecfg or cfg.engine,
                         temperature=cfg.rollout.temperature, max_len=cfg.rollout.max_new_tokens,
                         mask_truncated=mask_truncated, max_grad_norm=cfg.trainer.max_grad_norm)


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "dr_grpo"])
def test_gradient_accumulation_does_not_change_the_gradient(fixed, monkeypatch, agg):
    from grpo.update import _plan

    run, cfg, batch = fixed
    grads = _capture_grads(monkeypatch, run)
    acfg = dataclasses.replace(cfg.algorithm, loss_agg=agg)
    budget = max(len(p) for p in batch.prompt_ids) + 8
    small = dataclasses.replace(cfg.engine, max_tokens_per_micro_batch=budget)
    assert len(_plan(batch, small)) > 3  # groups split across micro-batches
    whole = _update(run, cfg, batch, acfg, dataclasses.replace(cfg.engine, max_tokens_per_micro_batch=10_000))
    split = _update(run, cfg, batch, acfg, small)
    assert whole["loss"] == pytest.approx(split["loss"], abs=1e-6)
    for n in grads[0]:
        assert torch.allclose(grads[0][n], grads[1][n], atol=1e-6), n


def test_mask_truncated_equals_dropping_the_truncated_completions(fixed, monkeypatch):
    from grpo.update import Batch

    run, cfg, batch = fixed
    grads = _capture_grads(monkeypatch, run)
    masked = _update(run, cfg, batch, mask_truncated=True)
    keep = [not t for flags in batch.truncated for t in flags]
    idx = torch.tensor([i for i, k in enumerate(keep) if k])
    short = Batch(batch.rows, batch.prompt_ids, [[c for c, t in zip(g, f) if not t] for g, f in
                                                  zip(batch.completion_ids, batch.truncated)],
                  [[False] * 2 for _ in batch.rows], batch.rewards[idx], batch.advantages[idx])
    dropped = _update(run, cfg, short)
    assert masked["loss"] == pytest.approx(dropped["loss"], abs=1e-6)
    assert masked["entropy"] == pytest.approx(dropped["entropy"], rel=1e-5)
    for n in grads[0]:
        assert torch.allclose(grads[0][n], grads[1][n], atol=1e-6), n


def test_all_truncated_batch_is_skipped_cleanly(fixed, monkeypatch):
    import grpo.update

    run, cfg, batch = fixed
    everything_cut = dataclasses.replace(batch, truncated=[[True] * 4 for _ in batch.rows])
    calls = []
    monkeypatch.setattr(grpo.update, "token_logprobs", lambda *a, **k: calls.append(1))
    monkeypatch.setattr(run.runtime, "step", lambda *a: calls.append("step"))
    before = _params(run.model)
    stats = _update(run, cfg, everything_cut, mask_truncated=True)
    assert stats["skipped"] and stats["empty_batch"] and stats["loss"] is None
    assert calls == []  # no forward, no optimizer step
    assert all(torch.equal(before[n], p) for n, p in run.model.named_parameters())


# -------------------------------------------------------------------------------- end to end
def test_zero_std_groups_filtered_and_empty_batches_skip_cleanly(cfg_factory, spy, monkeypatch):
    # every reward equal: every group is dropped, every step has an empty batch; more steps than
    # trainer.max_bad_steps, and the run still finishes (an empty batch is not a bad step)
    _use_reward(monkeypatch, lambda prompts, completions, **kw: [1.0] * len(completions))
    cfg, rows = _train(cfg_factory, {"algorithm": {"filter_zero_std_groups": True, "resample_zero_std": 1,
                                                   "beta": 0.1}, "trainer": {"max_steps": 4, "max_bad_steps": 2}})
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert r["zero_std_frac"] == 1.0 and r["dropped_groups"] == 4 and r["resample_rounds"] == 1
        assert r["num_groups"] == 0 and r["empty_batch"] is True and r["skipped"] is True
        assert r["loss"] is None and r["grad_norm"] == 0.0
    assert rows[-1]["skipped_steps"] == 4
    assert spy.rollouts == 8 and spy.logprob_passes == 4  # 2 rounds per step; the reference pass sees 0 groups
    assert all(torch.equal(spy.initial[n], p) for n, p in spy.run.policy.named_parameters())  # no step


def test_resampling_refills_the_batch_with_groups_that_have_signal(cfg_factory, spy, monkeypatch):
    # round 1: group 0 has signal, group 1 not; round 2: both have signal -> kept: g0 of round 1 + g0 of round 2
    _use_reward(monkeypatch, scheduled_reward([[True, False], [True, True], [False, False]], group_size=4))
    cfg, rows = _train(cfg_factory, {"algorithm": {"filter_zero_std_groups": True, "resample_zero_std": 3},
                                     "trainer": {"max_steps": 2}})
    first, second = rows
    assert first["zero_std_frac"] == 0.5 and first["dropped_groups"] == 1 and first["resample_rounds"] == 1
    assert first["num_groups"] == 2 and first["empty_batch"] is False and math.isfinite(first["loss"])
    # step 2: no signal anywhere, 3 extra rounds (the limit), nothing kept
    assert second["resample_rounds"] == 3 and second["dropped_groups"] == 8 and second["empty_batch"] is True
    assert spy.rollouts == 2 + 4
    assert first["reward_mean"] == pytest.approx(0.25)  # reward metrics describe the first round


def test_without_filtering_zero_std_groups_stay_with_zero_advantage(cfg_factory, spy, monkeypatch):
    _use_reward(monkeypatch, scheduled_reward([[True, False]], group_size=4))
    cfg, rows = _train(cfg_factory, {"trainer": {"max_steps": 1}})
    assert rows[0]["zero_std_frac"] == 0.5 and "dropped_groups" not in rows[0]
    assert spy.rollouts == 1


def test_several_iterations_per_batch_move_the_ratio(cfg_factory, spy):
    # mu = 2, high lr: rollouts every 2 steps, old log-probs once per batch, ratio 1 on pass 1 only
    cfg, rows = _train(cfg_factory, {"algorithm": {"num_iterations": 2, "beta": 0.0, "epsilon": 0.01},
                                     "trainer": {"max_steps": 4, "lr": 0.05}})
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert spy.rollouts == 2 and spy.logprob_passes == 2  # the old-policy pass, once per batch
    for first, second in (rows[0:2], rows[2:4]):
        assert first["ratio_mean"] == pytest.approx(1.0, abs=1e-5) and first["clip_ratio"] == 0.0
        assert abs(second["ratio_mean"] - 1.0) > 1e-3
        assert second["clip_ratio_low"] + second["clip_ratio_high"] > 0
        assert second["reward_mean"] == first["reward_mean"]  # the same rollouts
        assert second["loss"] != pytest.approx(0.0, abs=1e-6)
    for r in rows:  # the metrics every switch promises, on every optimizer step
        for key in ("clip_ratio_low", "clip_ratio_high", "entropy", "zero_std_frac", "truncated_frac"):
            assert r[key] is not None and math.isfinite(r[key]), key
        assert r["kl"] is None  # beta = 0: there is no reference, so no KL is logged (not a 0.0 that looks measured)
        assert r["entropy"] > 0 and 0 <= r["truncated_frac"] <= 1


def test_gspo_end_to_end(cfg_factory, spy):
    cfg, rows = _train(cfg_factory, {"algorithm": {"importance_sampling": "sequence", "num_iterations": 2,
                                                   "epsilon": 3e-4, "epsilon_high": 4e-4, "beta": 0.0},
                                     "trainer": {"max_steps": 2, "lr": 0.05}})
    assert rows[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert abs(rows[1]["ratio_mean"] - 1.0) > 1e-4 and rows[1]["clip_ratio"] > 0
    assert all(math.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in rows)


def test_logged_loss_is_zero_with_one_iteration_but_the_gradient_is_not(cfg_factory, spy):
    # docs/algorithms.md: ratio 1 and advantages of zero mean per group -> loss 0 (seq_mean_token_mean, beta 0)
    cfg, rows = _train(cfg_factory, {"algorithm": {"beta": 0.0}, "trainer": {"max_steps": 2}})
    for r in rows:
        assert r["loss"] == pytest.approx(0.0, abs=1e-5) and r["grad_norm"] > 0


def test_beta_zero_loads_no_reference_and_runs_no_reference_forward(cfg_factory, spy, monkeypatch):
    import grpo.setup

    refs = []
    monkeypatch.setattr(grpo.setup.Run, "reference_context", lambda self: refs.append(1))
    monkeypatch.setattr(grpo.setup, "load_reference", lambda *a, **k: refs.append(1))
    cfg, rows = _train(cfg_factory, {"algorithm": {"beta": 0.0}, "trainer": {"max_steps": 2}})
    assert spy.run.reference is None and refs == []
    assert spy.logprob_passes == 0  # mu = 1, no reference: the update's forward is the only one
    assert all(r["kl"] is None for r in rows)  # nothing to measure a KL against


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_in_the_loss_each_estimator(cfg_factory, spy, estimator):
    cfg, rows = _train(cfg_factory, {"algorithm": {"beta": 0.1, "kl_estimator": estimator},
                                     "trainer": {"max_steps": 2, "lr": 0.02}})
    assert spy.run.reference is not None
    assert spy.logprob_passes == 2  # the reference pass only (the update measures the KL itself)
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # policy == reference before the first step
    assert rows[1]["kl"] != pytest.approx(0.0, abs=1e-7)
    if estimator != "k1":
        assert rows[1]["kl"] > 0


def test_kl_in_the_reward(cfg_factory, spy, monkeypatch):
    """r_i - beta * sum_t KL_t replaces the reward before normalisation; the loss has no KL term."""
    from grpo import experience
    from grpo.loss import kl_estimate
    from grpo.setup import build_run
    from grpo.update import nested_logprobs

    cfg = cfg_factory(_merge(FAST, {"algorithm": {"beta": 0.5, "kl_in_reward": True, "kl_estimator": "k3"},
                                    "trainer": {"lr": 0.05}}))
    run = build_run(cfg)
    first = experience.collect(run, cfg)
    assert first.stats["kl"] == pytest.approx(0.0, abs=1e-6)
    stats = _update(run, cfg, first)
    assert "kl" not in stats  # not in the loss
    batch = experience.collect(run, cfg)  # the policy has moved: KL > 0
    task = spy.scores[-1]
    logps = nested_logprobs(run.model, batch, cfg.engine, cfg.rollout.temperature)
    seq_kl = torch.tensor([float(kl_estimate(lp, ref, "k3").sum()) for gl, gr in zip(logps, batch.ref_logps)
                           for lp, ref in zip(gl, gr)])
    assert seq_kl.sum() > 0 and batch.stats["kl"] > 0
    assert torch.allclose(batch.rewards, task - 0.5 * seq_kl, atol=1e-5)
    assert torch.allclose(batch.advantages, compute_advantages(task - 0.5 * seq_kl, batch.group_sizes), atol=1e-4)


def test_dr_grpo_end_to_end(cfg_factory, spy):
    cfg, rows = _train(cfg_factory, {"algorithm": {"loss_agg": "dr_grpo", "scale_rewards": "none"},
                                     "trainer": {"max_steps": 2}})
    assert all(math.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in rows)


def test_mask_truncated_end_to_end(cfg_factory, spy):
    # 8 new tokens: the random tiny model rarely stops, so most (often all) completions are truncated
    cfg, rows = _train(cfg_factory, {"algorithm": {"mask_truncated": True}, "trainer": {"max_steps": 2}})
    for r in rows:
        assert r["empty_batch"] == (r["truncated_frac"] == 1.0)
        assert r["empty_batch"] or (math.isfinite(r["loss"]) and r["grad_norm"] > 0)

