"""Every `algorithm` switch end to end (docs/algorithms.md).

Pure pieces are checked on hand-computed batches; the switches that live in the loop (filtering and
resampling, several passes per batch, truncation masking, where the KL goes, GSPO) run the real
`grpo.trainer.loop.fit` on the smoke recipe (tiny Llama, a few steps) or the real `policy_update` on a fixed
batch with the optimizer step replaced by a gradient capture.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
from types import SimpleNamespace

import pytest
import torch

from grpo import experience
from grpo.algorithm.advantages import compute_advantages
from grpo.algorithm.aggregation import BatchCounts, token_weights
from grpo.algorithm.loss import grpo_loss

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


def _collect(run):
    return experience.collect(run.sampler, run.runtime, run.settings.collect, run)


class SpyBackend:
    """The run's real rollout backend, injected in its place: counts the rollouts (``calls``) and lets a test
    rewrite what comes back (``spy.rewrite(completions)``, in place)."""

    def __init__(self, inner, spy):
        self.inner, self.spy, self.calls = inner, spy, 0

    def generate(self, *a, **k):
        self.calls += 1
        out = self.inner.generate(*a, **k)
        if self.spy.rewrite is not None:
            self.spy.rewrite(out)
        return out

    def sync_weights(self, model, version):
        self.inner.sync_weights(model, version)

    def stats(self):
        return self.inner.stats()

    def sleep(self):
        self.inner.sleep()

    def close(self):
        self.inner.close()


@pytest.fixture
def spy(monkeypatch):
    """Wraps fit(): keeps the Run, counts rollouts (a `SpyBackend` injected as the run's rollout backend) and
    log-prob passes, snapshots the initial weights."""
    import grpo.experience
    import grpo.trainer.loop

    s = SimpleNamespace(run=None, initial=None, backend=None, logprob_passes=0, scores=[], rewrite=None)
    build = grpo.trainer.loop.build_run

    def build_run(cfg):
        s.run = build(cfg)
        s.initial = _params(s.run.policy)
        s.run.sampler.backend.backend = s.backend = SpyBackend(s.run.sampler.backend.make(), s)
        return s.run

    nested, score = grpo.experience.nested_logprobs, grpo.experience.score_groups

    def nested_logprobs(*a, **k):
        s.logprob_passes += 1
        return nested(*a, **k)

    def score_groups(*a, **k):
        rewards, scores, sums = score(*a, **k)
        s.scores.append(rewards.clone())
        return rewards, scores, sums

    monkeypatch.setattr(grpo.trainer.loop, "build_run", build_run)
    monkeypatch.setattr(grpo.experience, "nested_logprobs", nested_logprobs)
    monkeypatch.setattr(grpo.experience, "score_groups", score_groups)
    return s


def _train(cfg_factory, *overrides):
    from grpo.trainer.loop import fit

    cfg = cfg_factory(_merge(FAST, *overrides))
    fit(cfg)
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
    import grpo.trainer.build
    from grpo.rewards.score import RewardFunction

    monkeypatch.setattr(grpo.trainer.build, "build_rewards", lambda spec, *args: [RewardFunction("accuracy", fn)])


PATTERN = [0.0, 1.0, 3.0, 0.5]


def pattern_reward(prompts, completions, **kwargs):
    """Rewards 0, 1, 3, 0.5 in every group of 4: a spread whose std scaling and centring differ."""
    return [PATTERN[i % 4] for i in range(len(completions))]


@pytest.fixture
def ragged(spy):
    """The real rollout, then completions cut to 1, 3 or 5 tokens followed by EOS (one in four left as sampled,
    usually truncated): the random tiny model rarely stops by itself, and the switches that depend on lengths
    or truncation need both kinds in every batch."""

    def rewrite(out):
        eos = spy.run.tokenizer.eos_token_id
        for g, group in enumerate(out.ids):
            for j, c in enumerate(group):
                n = [1, 3, 5, None][(g + j) % 4]
                if n is not None:
                    group[j] = [t for t in c if t != eos][:n] + [eos]
                    out.truncated[g][j] = False

    spy.rewrite = rewrite


@pytest.fixture
def oracle(monkeypatch, spy):
    """Wraps the loop's policy_update: before each call, the from-scratch loss (tests/oracle.py: plain HF forwards
    of the policy, of pi_old = the weights at the batch's first pass, and of the reference) and its gradient norm,
    for the run's config and for each of ``variants`` (name -> AlgorithmConfig fields, plus ``mask_truncated`` /
    ``temperature``). ``calls``: one dict per optimizer step with the real ``stats`` and each variant's numbers."""
    import grpo.trainer.loop
    from tests.oracle import flat, hf_logprobs, oracle_grads

    o = SimpleNamespace(calls=[], variants={})
    real = grpo.trainer.loop.policy_update
    held = {"batch": None, "old": None}

    def policy_update(runtime, batch, settings):
        model = runtime.model
        acfg, temperature, mask_truncated = settings.algorithm, settings.temperature, settings.mask_truncated
        max_len = settings.max_len
        if batch is not held["batch"]:
            held["batch"], held["old"] = batch, copy.deepcopy(model)
        prompts = [p for p, g in zip(batch.prompt_ids, batch.completion_ids) for _ in g]
        comps = flat(batch.completion_ids)
        call = {}
        for name, over in {"config": {}, **o.variants}.items():
            over = dict(over)
            t, masked = over.pop("temperature", temperature), over.pop("mask_truncated", mask_truncated)
            a = dataclasses.replace(acfg, **over)
            with torch.no_grad():
                old = hf_logprobs(held["old"], prompts, comps, t) if a.num_iterations > 1 else None
                ref = hf_logprobs(spy.run.reference, prompts, comps, t) if a.beta > 0 and not a.kl_in_reward else None
            loss, grads, kl = oracle_grads(model, batch, a, temperature=t, max_len=max_len, mask_truncated=masked,
                                           old=old, ref=ref)
            norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads.values()))
            call[name] = {"loss": loss, "grad_norm": norm, "kl": kl}
        call["batch"] = batch
        call["stats"] = real(runtime, batch, settings)
        o.calls.append(call)
        return call["stats"]

    monkeypatch.setattr(grpo.trainer.loop, "policy_update", policy_update)
    return o


def assert_matches_oracle(call: dict, *, differs_from: str | None = None, margin: float = 1e-3) -> None:
    """The step's logged loss and gradient norm are the oracle's for the config; and, so that a switch the
    code ignored cannot pass, the variant ``differs_from`` (the switch off) would have given another update."""
    stats, want = call["stats"], call["config"]
    assert stats["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-7)
    assert stats["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
    if want["kl"] is not None:
        assert stats["kl"] == pytest.approx(want["kl"], rel=1e-5, abs=1e-9)
    if differs_from is not None:
        other = call[differs_from]
        assert (abs(other["loss"] - want["loss"]) > margin * max(abs(want["loss"]), 1e-2)
                or abs(other["grad_norm"] - want["grad_norm"]) > margin * want["grad_norm"]), (want, other)


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
    from grpo.errors import ConfigError

    with pytest.raises(ConfigError, match="resample_zero_std=2 needs algorithm.filter_zero_std_groups=true"):
        cfg_factory({"algorithm": {"resample_zero_std": 2}})
    with pytest.raises(ConfigError, match="resample_zero_std=-1 is out of range"):
        cfg_factory({"algorithm": {"resample_zero_std": -1, "filter_zero_std_groups": True}})


# ----------------------------------------------------------------- policy_update on a fixed batch
@pytest.fixture(scope="module")
def fixed(tmp_path_factory):
    """A built run (tiny Llama) and a fixed batch of 3 prompts x 4 random completions of ragged lengths."""
    from omegaconf import OmegaConf

    from grpo.batch import Batch
    from grpo.config.schema import load
    from grpo.trainer.build import build_run
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
    from grpo.trainer.settings import derive
    from grpo.update import policy_update

    settings = dataclasses.replace(derive(cfg).update, algorithm=acfg or cfg.algorithm,
                                   engine=ecfg or cfg.engine, mask_truncated=mask_truncated)
    return policy_update(run.runtime, batch, settings)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "dr_grpo"])
def test_gradient_accumulation_does_not_change_the_gradient(fixed, monkeypatch, agg, level):
    """Whole batch vs micro-batches that split groups, beyond the defaults: old log-probs away from the current
    ones (mu > 1: clipping acts), a reference (beta > 0), token or GSPO ratios, mask_truncated."""
    from grpo.engine.batch_logprobs import nested_logprobs
    from grpo.engine.batch_logprobs import plan as _plan

    run, cfg, batch = fixed
    gen = torch.Generator().manual_seed(1)
    now = nested_logprobs(run.runtime, run.model, batch, cfg.engine, cfg.rollout.temperature)
    moved = lambda: [[lp + 0.3 * torch.randn(lp.shape, generator=gen) for lp in g] for g in now]  # noqa: E731
    batch = dataclasses.replace(batch, old_logps=moved(), ref_logps=moved())
    grads = _capture_grads(monkeypatch, run)
    acfg = dataclasses.replace(cfg.algorithm, loss_agg=agg, importance_sampling=level, beta=0.1,
                               epsilon=0.05, epsilon_high=0.08)
    budget = max(len(p) for p in batch.prompt_ids) + 8
    small = dataclasses.replace(cfg.engine, max_tokens_per_micro_batch=budget)
    assert len(_plan(batch, small)) > 3  # groups split across micro-batches
    whole = _update(run, cfg, batch, acfg, dataclasses.replace(cfg.engine, max_tokens_per_micro_batch=10_000),
                    mask_truncated=True)
    split = _update(run, cfg, batch, acfg, small, mask_truncated=True)
    assert whole["clip_ratio"] > 0  # clipping acts
    for k in ("loss", "kl", "clip_ratio_low", "clip_ratio_high", "ratio_mean"):
        assert whole[k] == pytest.approx(split[k], rel=1e-5, abs=1e-7), k
    for n in grads[0]:
        assert torch.allclose(grads[0][n], grads[1][n], atol=1e-6), n


def test_rollout_is_metrics_over_micro_batches_with_one_collective_of_their_own(fixed, monkeypatch):
    """A sampler with its own log-probs (vLLM): the update's rollout_is/* metrics equal `rollout_is` over the whole
    batch at once, also when micro-batches split groups; the correction's sums ride the update's all_reduce, its
    maxima take the one extra collective (an all_max)."""
    from grpo.algorithm.loss import pad
    from grpo.algorithm.rollout_is import rollout_is, summarize
    from grpo.engine.batch_logprobs import nested_logprobs

    run, cfg, batch = fixed
    gen = torch.Generator().manual_seed(2)
    now = nested_logprobs(run.runtime, run.model, batch, cfg.engine, cfg.rollout.temperature)
    batch = dataclasses.replace(batch, sampling_logps=[[lp + 0.5 * torch.randn(lp.shape, generator=gen) for lp in g]
                                                       for g in now])
    _capture_grads(monkeypatch, run)
    calls = []
    for name in ("all_reduce", "all_max"):
        real = getattr(run.runtime, name)
        monkeypatch.setattr(run.runtime, name, lambda v, real=real, name=name: calls.append(name) or real(v))
    budget = max(len(p) for p in batch.prompt_ids) + 8
    lp, mask = pad([t for g in now for t in g])
    a = cfg.algorithm  # token_truncate, cap 2 (the defaults)
    want = summarize(rollout_is(lp, pad([t for g in batch.sampling_logps for t in g])[0], mask, a.rollout_is,
                                a.rollout_is_cap)[1])
    assert 0 < want["rollout_is/capped_frac"] < 1
    for engine in (10_000, budget):
        calls.clear()
        out = _update(run, cfg, batch, ecfg=dataclasses.replace(cfg.engine, max_tokens_per_micro_batch=engine))
        assert calls == ["all_reduce", "all_reduce", "all_max"]  # batch counts, the update's totals, the maxima
        for k, v in want.items():
            assert out[k] == pytest.approx(v, rel=1e-5), k


@pytest.mark.parametrize("mu", [1, 2], ids=["proximal=current", "proximal=old"])
@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate"])
def test_a_stale_batch_trains_on_the_oracles_decoupled_objective(fixed, monkeypatch, mode, mu):
    """Asynchronous GRPO (docs/async.md#the-objective): a batch sampled by older weights (the behaviour policy: a
    perturbed copy of the policy, its log-probs from the oracle's own per-sequence forward) trains on decoupled PPO
    (AReaL, arXiv:2505.24298): the clipped ratio against the proximal policy (the weights when the step starts, or
    with mu > 1 the old log-probs), times min(pi_prox / pi_behaviour, C). Loss and every gradient match the
    oracle, with the cap acting on some tokens and not on others."""
    from tests.helpers import nest_like
    from tests.oracle import assert_grads_close, close, flat, hf_logprobs, old_and_reference_logprobs, oracle_grads

    run, cfg, batch = fixed
    T, gen = cfg.rollout.temperature, torch.Generator().manual_seed(3)
    stale = copy.deepcopy(run.model)
    with torch.no_grad():
        for p in stale.parameters():
            p.add_(2.0 * p.abs().mean() * torch.randn(p.shape, generator=gen))
        rows = [p for p, g in zip(batch.prompt_ids, batch.completion_ids) for _ in g]
        behaviour = hf_logprobs(stale, rows, flat(batch.completion_ids), T)
    old = None if mu == 1 else old_and_reference_logprobs(run.model, run.model, batch, T, gen)[0]
    stale_batch = dataclasses.replace(batch, sampling_logps=nest_like(batch, behaviour),
                                      old_logps=None if old is None else nest_like(batch, old))
    acfg = dataclasses.replace(cfg.algorithm, epsilon=0.1, rollout_is=mode, rollout_is_cap=1.5)
    grads = _capture_grads(monkeypatch, run)
    from grpo.trainer.settings import derive
    from grpo.update import policy_update

    settings = dataclasses.replace(derive(cfg).update, algorithm=acfg, rollout_is=mode, rollout_is_cap=1.5)
    out = policy_update(run.runtime, stale_batch, settings)
    loss, want, _ = oracle_grads(run.model, batch, acfg, temperature=T, max_len=settings.max_len,
                                 mask_truncated=False, old=old, behaviour=behaviour, is_mode=mode, is_cap=1.5)
    assert 0 < out["rollout_is/capped_frac"] < 1  # the cap acts on some, not all
    assert close(out["loss"], loss, rel=1e-5, abs_=1e-6), (out["loss"], loss)
    assert_grads_close(grads[0], want, rel=1e-4)


def test_mask_truncated_equals_dropping_the_truncated_completions(fixed, monkeypatch):
    from grpo.batch import Batch

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
    assert spy.backend.calls == 8 and spy.logprob_passes == 4  # 2 rounds per step; the reference pass sees 0 groups
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
    assert spy.backend.calls == 2 + 4
    assert first["reward_mean"] == pytest.approx(0.25)  # reward metrics describe the first round


def test_each_refill_round_keeps_the_groups_its_own_rewards_select(cfg_factory, monkeypatch):
    """Round 1: group 0 has signal; round 2: none; round 3: only group 1; round 4 never runs (the batch is full).
    Kept: group 0 of round 1 and group 1 of round 3, in that order, each with its own rows, completions and rewards
    (selecting with another round's flags would keep a zero-std group, or stop a round early)."""
    from grpo import experience
    from grpo.trainer.build import build_run

    _use_reward(monkeypatch, scheduled_reward([[True, False], [False, False], [False, True], [True, True]], 4))
    rounds, rollout = [], experience._rollout
    monkeypatch.setattr(experience, "_rollout", lambda *a: rounds.append(rollout(*a)) or rounds[-1])
    cfg = cfg_factory(_merge(FAST, {"algorithm": {"filter_zero_std_groups": True, "resample_zero_std": 5,
                                                  "beta": 0.0}}))
    batch = _collect(build_run(cfg))
    assert len(rounds) == 3
    assert batch.stats["resample_rounds"] == 2 and batch.stats["dropped_groups"] == 1 + 2 + 1
    assert batch.stats["num_groups"] == 2 and batch.group_sizes == [4, 4]
    picks = [(rounds[0], 0), (rounds[2], 1)]
    assert batch.rows == [r.rows[g] for r, g in picks]
    assert batch.completion_ids == [r.completion_ids[g] for r, g in picks]
    assert torch.equal(batch.rewards, torch.cat([r.rewards[4 * g:4 * g + 4] for r, g in picks]))
    assert batch.rewards.tolist() == [0.0, 1.0] * 4 and bool((batch.advantages != 0).all())
    assert batch.stats["zero_std_frac"] == 0.5 and batch.stats["reward_mean"] == pytest.approx(0.25)  # round 1's
    # the limit: resample_zero_std=1 runs one extra round, however short the batch still is
    _use_reward(monkeypatch, scheduled_reward([[True, False], [False, False], [True, True]], 4))
    rounds.clear()
    cfg = cfg_factory(_merge(FAST, {"algorithm": {"filter_zero_std_groups": True, "resample_zero_std": 1,
                                                  "beta": 0.0}}))
    batch = _collect(build_run(cfg))
    assert len(rounds) == 2 and batch.stats["resample_rounds"] == 1 and batch.group_sizes == [4]


def test_without_filtering_zero_std_groups_stay_with_zero_advantage(cfg_factory, spy, monkeypatch):
    _use_reward(monkeypatch, scheduled_reward([[True, False]], group_size=4))
    cfg, rows = _train(cfg_factory, {"trainer": {"max_steps": 1}})
    assert rows[0]["zero_std_frac"] == 0.5 and "dropped_groups" not in rows[0]
    assert spy.backend.calls == 1


def test_several_iterations_per_batch_move_the_ratio(cfg_factory, spy):
    # mu = 2, high lr: rollouts every 2 steps, old log-probs once per batch, ratio 1 on pass 1 only
    cfg, rows = _train(cfg_factory, {"algorithm": {"num_iterations": 2, "beta": 0.0, "epsilon": 0.01},
                                     "trainer": {"max_steps": 4, "lr": 0.05}})
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert spy.backend.calls == 2 and spy.logprob_passes == 2  # the old-policy pass, once per batch
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


def test_gspo_end_to_end(cfg_factory, spy, ragged, oracle, monkeypatch):
    """Pass 2 of a batch (mu = 2): the update is the oracle's with one length-normalised ratio per completion,
    not the per-token ratio."""
    _use_reward(monkeypatch, pattern_reward)
    oracle.variants = {"token": {"importance_sampling": "token"}}
    cfg, rows = _train(cfg_factory, {"algorithm": {"importance_sampling": "sequence", "num_iterations": 2,
                                                   "epsilon": 0.02, "epsilon_high": 0.03, "beta": 0.0},
                                     "trainer": {"max_steps": 2, "lr": 0.05}})
    first, second = oracle.calls
    assert rows[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert abs(rows[1]["ratio_mean"] - 1.0) > 1e-3
    assert_matches_oracle(first)
    assert_matches_oracle(second, differs_from="token")


def test_logged_loss_is_zero_with_one_iteration_but_the_gradient_is_not(cfg_factory, spy):
    # docs/algorithms.md: ratio 1 and advantages of zero mean per group -> loss 0 (seq_mean_token_mean, beta 0)
    cfg, rows = _train(cfg_factory, {"algorithm": {"beta": 0.0}, "trainer": {"max_steps": 2}})
    for r in rows:
        assert r["loss"] == pytest.approx(0.0, abs=1e-5) and r["grad_norm"] > 0


def test_beta_zero_loads_no_reference_and_runs_no_reference_forward(cfg_factory, spy, monkeypatch, capsys):
    import grpo.trainer.build
    import grpo.trainer.run

    refs = []
    monkeypatch.setattr(grpo.trainer.run.Run, "reference_context", lambda self: refs.append(1))
    monkeypatch.setattr(grpo.trainer.build, "load_reference", lambda *a, **k: refs.append(1))
    cfg, rows = _train(cfg_factory, {"algorithm": {"beta": 0.0}, "trainer": {"max_steps": 2}})
    assert spy.run.reference is None and refs == []
    assert spy.logprob_passes == 0  # mu = 1, no reference: the update's forward is the only one
    assert all(r["kl"] is None for r in rows)  # nothing to measure a KL against
    # docs/algorithms.md: null in metrics.jsonl, `kl n/a` on the console (not 0, not a silent gap)
    lines = [l for l in capsys.readouterr().err.splitlines() if l.startswith("step ")]
    assert len(lines) == 2 and all("  kl n/a  " in l for l in lines)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_in_the_loss_each_estimator(cfg_factory, spy, ragged, oracle, monkeypatch, estimator):
    """Step 2 (the policy has moved off the reference): the logged KL and the update are the oracle's with this
    estimator; another estimator gives another KL."""
    _use_reward(monkeypatch, pattern_reward)
    oracle.variants = {"other": {"kl_estimator": {"k1": "k3", "k2": "k3", "k3": "k2"}[estimator]}}
    cfg, rows = _train(cfg_factory, {"algorithm": {"beta": 0.5, "kl_estimator": estimator},
                                     "trainer": {"max_steps": 2, "lr": 0.05}})
    assert spy.run.reference is not None
    assert spy.logprob_passes == 2  # the reference pass only (the update measures the KL itself)
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # policy == reference before the first step
    first, second = oracle.calls
    assert_matches_oracle(first)
    assert_matches_oracle(second)
    kl, other = second["config"]["kl"], second["other"]["kl"]
    assert rows[1]["kl"] == pytest.approx(kl, rel=1e-5)
    assert abs(kl - other) > 1e-2 * abs(kl) and abs(kl) > 1e-4


def test_kl_in_the_reward(cfg_factory, spy, monkeypatch):
    """r_i - beta * sum_t k3_t replaces the reward before normalisation; the loss has no KL term. The expectation
    is computed from scratch (plain HF forwards of the policy and the reference, k3 and the group std written out)."""
    from grpo import experience
    from grpo.trainer.build import build_run
    from tests.oracle import flat, hf_logprobs

    _use_reward(monkeypatch, pattern_reward)
    cfg = cfg_factory(_merge(FAST, {"algorithm": {"beta": 0.5, "kl_in_reward": True, "kl_estimator": "k3"},
                                    "trainer": {"lr": 0.05}}))
    run = build_run(cfg)
    first = experience.collect(run.sampler, run.runtime, run.settings.collect, run)
    assert first.stats["kl"] == pytest.approx(0.0, abs=1e-6)
    stats = _update(run, cfg, first)
    assert "kl" not in stats  # not in the loss
    batch = experience.collect(run.sampler, run.runtime, run.settings.collect, run)  # the policy has moved: KL > 0
    task = spy.scores[-1]
    prompts = [p for p, g in zip(batch.prompt_ids, batch.completion_ids) for _ in g]
    with torch.no_grad():
        lp = hf_logprobs(run.model, prompts, flat(batch.completion_ids), cfg.rollout.temperature)
        ref = hf_logprobs(run.reference, prompts, flat(batch.completion_ids), cfg.rollout.temperature)
    k3 = [torch.exp(r - l) - (r - l) - 1 for l, r in zip(lp, ref)]
    seq_kl = torch.tensor([float(k.sum()) for k in k3])
    assert float(seq_kl.sum()) > 1e-4
    assert batch.stats["kl"] == pytest.approx(float(seq_kl.sum()) / sum(len(k) for k in k3), rel=1e-4)
    want = task - 0.5 * seq_kl
    assert torch.allclose(batch.rewards, want, atol=1e-6)
    groups = want.view(-1, cfg.algorithm.group_size).double()
    adv = (groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + cfg.algorithm.adv_eps)
    assert torch.allclose(batch.advantages, adv.flatten().float(), atol=1e-5)


def test_dr_grpo_end_to_end(cfg_factory, spy, ragged, oracle, monkeypatch):
    """Advantages only centred (no std), and the loss summed over tokens / (N * max_new_tokens)."""
    _use_reward(monkeypatch, pattern_reward)
    oracle.variants = {"grpo": {"loss_agg": "seq_mean_token_mean"}}
    cfg, rows = _train(cfg_factory, {"algorithm": {"loss_agg": "dr_grpo", "scale_rewards": "none", "beta": 0.0},
                                     "trainer": {"max_steps": 2}})
    centred = torch.tensor(PATTERN) - sum(PATTERN) / 4
    for call in oracle.calls:
        assert torch.allclose(call["batch"].advantages, centred.repeat(2), atol=1e-6)
        assert_matches_oracle(call, differs_from="grpo")


def test_mask_truncated_end_to_end(cfg_factory, spy, ragged, oracle, monkeypatch):
    """Batches with truncated and finished completions: the update is the oracle's without the truncated ones."""
    from tests.oracle import flat

    _use_reward(monkeypatch, pattern_reward)
    oracle.variants = {"unmasked": {"mask_truncated": False}}
    cfg, rows = _train(cfg_factory, {"algorithm": {"mask_truncated": True, "beta": 0.0}, "trainer": {"max_steps": 2}})
    for call, row in zip(oracle.calls, rows):
        cut = flat(call["batch"].truncated)
        assert any(cut) and not all(cut) and row["empty_batch"] is False
        assert_matches_oracle(call, differs_from="unmasked")


def test_rollout_temperature_reaches_every_log_prob(cfg_factory, spy, ragged, oracle, monkeypatch):
    """rollout.temperature != 1 with mu = 2 and beta > 0: the update's, pi_old's and the reference's log-probs
    all come from logits / T (the oracle at T = 1 gives another update)."""
    _use_reward(monkeypatch, pattern_reward)
    oracle.variants = {"t1": {"temperature": 1.0}}
    cfg, rows = _train(cfg_factory, {"rollout": {"temperature": 0.6}, "algorithm": {"num_iterations": 2, "beta": 0.2},
                                     "trainer": {"max_steps": 2, "lr": 0.05}})
    for call in oracle.calls:
        assert_matches_oracle(call, differs_from="t1")


def test_scale_rewards_batch_through_collect(cfg_factory, spy, monkeypatch):
    """collect with scale_rewards=batch: (r - group mean) / (std of every reward of the batch + adv_eps)."""
    from grpo.trainer.build import build_run

    rewards = [0.0, 1.0, 3.0, 0.5, 2.0, 2.5, 0.0, 4.0]
    _use_reward(monkeypatch, lambda prompts, completions, **kw: rewards[:len(completions)])
    cfg = cfg_factory(_merge(FAST, {"algorithm": {"scale_rewards": "batch", "beta": 0.0}}))
    batch = _collect(build_run(cfg))
    r = torch.tensor(rewards, dtype=torch.float64)
    groups = r.view(2, 4)
    want = (groups - groups.mean(1, keepdim=True)).flatten() / (r.std() + cfg.algorithm.adv_eps)
    assert torch.allclose(batch.advantages.double(), want, atol=1e-6)
    per_group = (groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + cfg.algorithm.adv_eps)
    assert not torch.allclose(batch.advantages.double(), per_group.flatten(), atol=1e-2)  # not the group std


class _ThreadRank:
    """Rank ``rank`` of a two-rank world whose ranks are threads: the collectives meet at a barrier, everything else
    is the real one-process runtime's (enough for `collect`: all_reduce, all_max, any_rank, gather)."""

    def __init__(self, real, world: dict, rank: int):
        self._real, self._world, self.rank, self.world_size = real, world, rank, 2

    def __getattr__(self, name):
        return getattr(self._real, name)

    def _meet(self, value):
        slots, barrier = self._world["slots"], self._world["barrier"]
        slots[self.rank] = value
        barrier.wait()
        out = list(slots)
        barrier.wait()
        return out

    def all_reduce(self, values):
        both = self._meet(dict(values))
        return {k: sum(v[k] for v in both) for k in values}

    def all_max(self, values):
        both = self._meet(dict(values))
        return {k: max(v[k] for v in both) for k in values}

    def any_rank(self, flag):
        return any(self._meet(bool(flag)))

    def gather(self, obj):
        return self._meet(obj)


def test_scale_rewards_batch_through_collect_on_two_ranks(cfg_factory, monkeypatch):
    """Two ranks (threads, one group each): collect divides by the std of both ranks' rewards, all-reduced, not by
    this rank's own (every one-process test passes either way); the reward metrics are both ranks' too."""
    import threading

    from grpo import experience
    from grpo.trainer.build import build_run

    per_rank = {"rank0": [0.0, 1.0, 3.0, 0.5], "rank1": [2.0, 2.5, 0.0, 4.0]}
    _use_reward(monkeypatch, lambda prompts, completions, **kw: per_rank[threading.current_thread().name])
    cfg = cfg_factory(_merge(FAST, {"algorithm": {"scale_rewards": "batch", "beta": 0.0}}))
    world = {"slots": [None, None], "barrier": threading.Barrier(2, timeout=120)}
    runs = [build_run(cfg), build_run(cfg)]
    for k, run in enumerate(runs):
        run.runtime = run.sampler.runtime = _ThreadRank(run.runtime, world, k)
    got, errors = [None, None], []

    def rank(k):
        try:
            got[k] = experience.collect(runs[k].sampler, runs[k].runtime, runs[k].settings.collect, runs[k])
        except BaseException as e:  # noqa: BLE001 - re-raised below, in the test's thread
            errors.append(e)
            world["barrier"].abort()

    threads = [threading.Thread(target=rank, args=(k,), name=f"rank{k}") for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    every = torch.tensor(per_rank["rank0"] + per_rank["rank1"], dtype=torch.float64)
    for k in (0, 1):
        r = torch.tensor(per_rank[f"rank{k}"], dtype=torch.float64)
        assert got[k].group_sizes == [4]
        want = (r - r.mean()) / (every.std() + cfg.algorithm.adv_eps)
        assert torch.allclose(got[k].advantages.double(), want, atol=1e-6)
        assert not torch.allclose(got[k].advantages.double(), (r - r.mean()) / (r.std() + cfg.algorithm.adv_eps),
                                  atol=1e-2)  # not this rank's own std
        assert got[k].stats["reward_mean"] == pytest.approx(float(every.mean()))
        assert got[k].stats["reward_std"] == pytest.approx(float(every.std()))


def test_top_p_top_k_warn_once_that_the_rollout_is_off_policy(monkeypatch):
    """The sampler draws from the truncated distribution while every log-prob uses the full softmax: say so once."""
    import warnings

    from grpo.models import char_tokenizer, tiny_model
    from grpo.rollout import hf as rollout

    monkeypatch.setattr(rollout, "_warned_truncated", False)
    model, tok = tiny_model("llama", 100), char_tokenizer()
    from grpo.rollout.base import Sampling

    kw = dict(group_size=2, progress=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rollout.generate(model, tok, [[5, 6]], Sampling(2), **kw)  # top_p=1, top_k=0: on-policy, nothing to say
        assert not [w for w in caught if "on-policy" in str(w.message)]
        rollout.generate(model, tok, [[5, 6]], Sampling(2, top_k=5), **kw)
        rollout.generate(model, tok, [[5, 6]], Sampling(2, top_p=0.9), **kw)
    msgs = [str(w.message) for w in caught if "on-policy" in str(w.message)]
    assert len(msgs) == 1 and msgs[0].startswith("rollout.top_p=1.0 / rollout.top_k=5: completions are sampled")


def test_a_failed_reward_counts_as_zero_in_its_group(cfg_factory, spy, monkeypatch):
    """docs/algorithms.md: a sample a reward function failed on gets 0 from that function (TRL's nansum) and
    still takes part in its group's mean and std."""
    from grpo.trainer.build import build_run

    calls = {"n": 0}

    def flaky(prompts, completions, **kw):  # the batch call raises; then sample by sample, odd ones raise
        if len(completions) > 1:
            raise RuntimeError("batch")
        calls["n"] += 1
        if calls["n"] % 2 == 0:
            raise ValueError("this sample breaks the reward")
        return [1.0 + calls["n"]]

    _use_reward(monkeypatch, flaky)
    cfg = cfg_factory(_merge(FAST, {"algorithm": {"beta": 0.0}}))
    batch = _collect(build_run(cfg))
    r = torch.tensor([2.0, 0.0, 4.0, 0.0, 6.0, 0.0, 8.0, 0.0])  # calls 1, 3, 5, 7 scored 1 + n; the others failed
    assert torch.equal(batch.rewards, r) and batch.stats["reward/accuracy_errors"] == 4
    groups = r.view(2, 4)
    want = (groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + cfg.algorithm.adv_eps)
    assert torch.allclose(batch.advantages, want.flatten(), atol=1e-6)
