"""`policy_update` against an independent from-scratch GRPO loss (tests/oracle.py).

A ragged two-group batch: completions that end with EOS (one is EOS alone), truncated ones, old
log-probs away from the current ones (both clip sides and the delta cap act), a reference model
(beta > 0), temperature 0.7, and micro-batches that split both groups. Loss, KL and every gradient must
match the oracle for every loss_agg x token/sequence ratio x mask_truncated.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from grpo.config.schema import AlgorithmConfig, EngineConfig
from grpo.runtime.base import Runtime
from tests.helpers import nest_like
from tests.oracle import assert_grads_close, close, flat, hf_logprobs, old_and_reference_logprobs, oracle_grads

EOS, VOCAB, MAX_LEN, TEMP = 2, 100, 8, 0.7
AGGS = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "dr_grpo"]


class CaptureRuntime(Runtime):
    """One process; the optimizer step is replaced by a capture of the accumulated gradients."""

    def __init__(self, model):
        self.model, self.grads = model, None

    def step(self, max_grad_norm):
        self.grads = {n: p.grad.clone() for n, p in self.model.named_parameters() if p.grad is not None}
        self.model.zero_grad(set_to_none=True)
        return 0.0, True


def _tokens(gen, n):
    return torch.randint(3, VOCAB, (n,), generator=gen).tolist()


@pytest.fixture(scope="module")
def setup():
    from grpo.batch import Batch
    from grpo.models import tiny_model

    policy = tiny_model("llama", VOCAB, seed=0)
    reference = tiny_model("llama", VOCAB, seed=1)
    gen = torch.Generator().manual_seed(0)
    prompts = [_tokens(gen, 7), _tokens(gen, 4)]
    # (length without EOS, ends with EOS); a completion without EOS is truncated at MAX_LEN
    shapes = [[(4, True), (0, True), (MAX_LEN, False)], [(2, True), (MAX_LEN, False), (5, True), (1, True)]]
    comps = [[_tokens(gen, n) + ([EOS] if eos else []) for n, eos in g] for g in shapes]
    truncated = [[not eos for _, eos in g] for g in shapes]
    adv = torch.tensor([1.3, -0.7, 0.9, -1.1, 0.6, 1.5, -0.4])
    batch = Batch([{}, {}], prompts, comps, truncated, torch.zeros(7), adv)
    old, ref = old_and_reference_logprobs(policy, reference, batch, TEMP, gen)
    return policy, batch, old, ref


def _run(policy, batch, acfg, ecfg, mask_truncated):
    from grpo.update import UpdateSettings, policy_update

    rt = CaptureRuntime(policy)
    policy.zero_grad(set_to_none=True)
    settings = UpdateSettings(acfg, ecfg, temperature=TEMP, max_len=MAX_LEN, mask_truncated=mask_truncated,
                              max_grad_norm=1.0)
    stats = policy_update(rt, batch, settings)
    return stats, rt.grads


def _algo(**kw):
    base = dict(beta=0.1, epsilon=0.2, epsilon_high=0.28, delta=2.0, kl_estimator="k3")
    return AlgorithmConfig(**{**base, **kw})


SPLIT = EngineConfig(shared_prefix=True, max_tokens_per_micro_batch=16, attention_kernel="grouped")


def test_the_batch_exercises_what_it_claims(setup):
    from grpo.engine.batch_logprobs import plan as _plan

    policy, batch, old, ref = setup
    plan = _plan(batch, SPLIT)
    assert len(plan) == 4 and all(len(mb) == 1 for mb in plan)  # each group split in two micro-batches
    with torch.no_grad():
        now = torch.cat(hf_logprobs(policy, [p for p, g in zip(batch.prompt_ids, batch.completion_ids) for _ in g],
                                    flat(batch.completion_ids), TEMP))
    ratio = torch.exp(now - torch.cat(old))
    assert (ratio < 0.8).any() and (ratio > 1.28).any() and (ratio > 2.0).any()
    assert any(t for t in flat(batch.truncated)) and not all(flat(batch.truncated))
    assert [EOS] in flat(batch.completion_ids)


@pytest.mark.parametrize("mask_truncated", [False, True])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("agg", AGGS)
def test_policy_update_matches_the_oracle(setup, agg, level, mask_truncated):
    policy, batch, old, ref = setup
    b = dataclasses.replace(batch, old_logps=nest_like(batch, old), ref_logps=nest_like(batch, ref))
    acfg = _algo(loss_agg=agg, importance_sampling=level)
    stats, grads = _run(policy, b, acfg, SPLIT, mask_truncated)
    loss, want, kl = oracle_grads(policy, b, acfg, temperature=TEMP, max_len=MAX_LEN, mask_truncated=mask_truncated,
                                  old=old, ref=ref)
    assert close(stats["loss"], loss), (stats["loss"], loss)
    assert close(stats["kl"], kl), (stats["kl"], kl)
    assert_grads_close(grads, want)


@pytest.mark.parametrize("engine", [
    EngineConfig(shared_prefix=True, max_tokens_per_micro_batch=10_000, attention_kernel="grouped"),
    EngineConfig(shared_prefix=False, max_tokens_per_micro_batch=16, attention_kernel="grouped"),
], ids=["shared-whole-batch", "standard-split"])
@pytest.mark.parametrize("agg,level", [("token_mean", "sequence"), ("dr_grpo", "token")])
def test_whole_batch_and_standard_layout_match_the_oracle(setup, engine, agg, level):
    policy, batch, old, ref = setup
    b = dataclasses.replace(batch, old_logps=nest_like(batch, old), ref_logps=nest_like(batch, ref))
    acfg = _algo(loss_agg=agg, importance_sampling=level, kl_estimator="k2")
    stats, grads = _run(policy, b, acfg, engine, True)
    loss, want, kl = oracle_grads(policy, b, acfg, temperature=TEMP, max_len=MAX_LEN, mask_truncated=True,
                                  old=old, ref=ref)
    assert close(stats["loss"], loss) and close(stats["kl"], kl)
    assert_grads_close(grads, want)


def test_one_pass_without_reference_matches_the_oracle(setup):
    """mu = 1 (no old log-probs: ratio 1, the plain policy gradient) and beta = 0 (no KL)."""
    policy, batch, _, _ = setup
    acfg = _algo(beta=0.0)
    stats, grads = _run(policy, batch, acfg, SPLIT, False)
    loss, want, _ = oracle_grads(policy, batch, acfg, temperature=TEMP, max_len=MAX_LEN, mask_truncated=False)
    assert close(stats["loss"], loss) and "kl" not in stats
    assert_grads_close(grads, want)


def _rel(a: dict, b: dict) -> float:
    num = sum(float((a[n] - b[n]).pow(2).sum()) for n in a)
    den = sum(float(b[n].pow(2).sum()) for n in b)
    return (num / den) ** 0.5


def test_loss_agg_changes_the_gradient_as_its_formula_says(setup):
    """Ratio 1, beta 0: every aggregation but seq_mean_token_mean is the same token sum divided by a different
    constant (T tokens, N sequences, N * L), so their gradients are exact rescalings of each other;
    seq_mean_token_mean weighs each completion by 1/|o_i| and points elsewhere."""
    policy, batch, _, _ = setup
    grads = {agg: _run(policy, batch, _algo(beta=0.0, loss_agg=agg), SPLIT, False)[1] for agg in AGGS}
    lengths = [len(c) for c in flat(batch.completion_ids)]
    T, N = sum(lengths), len(lengths)
    scaled = {"token_mean": T, "seq_mean_token_sum": N, "dr_grpo": N * MAX_LEN}
    base = {n: g * scaled["token_mean"] for n, g in grads["token_mean"].items()}
    for agg, c in scaled.items():
        assert _rel({n: g * c for n, g in grads[agg].items()}, base) < 1e-5, agg
        assert _rel(grads[agg], grads["token_mean"]) > 0.2 or agg == "token_mean"  # a different scale
    # seq_mean_token_mean is not a rescaling of the token sum: compare directions
    g_seq, g_tok = (torch.cat([g.flatten() for g in grads[a].values()]) for a in ("seq_mean_token_mean", "token_mean"))
    cosine = float(g_seq @ g_tok / (g_seq.norm() * g_tok.norm()))
    assert cosine < 0.99


def test_importance_sampling_changes_the_gradient(setup):
    """With old log-probs away from the current ones, GSPO's one ratio per completion gives another gradient
    than the per-token ratio; with ratio 1 (mu = 1) both are the same policy gradient."""
    policy, batch, old, _ = setup
    b = dataclasses.replace(batch, old_logps=nest_like(batch, old))
    tok = _run(policy, b, _algo(beta=0.0), SPLIT, False)[1]
    seq = _run(policy, b, _algo(beta=0.0, importance_sampling="sequence"), SPLIT, False)[1]
    assert _rel(seq, tok) > 0.1
    tok1 = _run(policy, batch, _algo(beta=0.0), SPLIT, False)[1]
    seq1 = _run(policy, batch, _algo(beta=0.0, importance_sampling="sequence"), SPLIT, False)[1]
    assert _rel(seq1, tok1) < 1e-5


def test_the_eos_token_is_in_the_loss(setup):
    """A completion that is EOS alone: its loss is -A * log p(EOS | prompt) / 1 (seq_mean_token_sum, N = 1)."""
    from grpo.batch import Batch

    policy, batch, _, _ = setup
    one = Batch([{}], [batch.prompt_ids[0]], [[[EOS]]], [[False]], torch.zeros(1), torch.tensor([2.0]))
    acfg = _algo(beta=0.0, loss_agg="seq_mean_token_sum")
    stats, grads = _run(policy, one, acfg, SPLIT, True)
    with torch.no_grad():
        logp = torch.log_softmax(policy(input_ids=torch.tensor([batch.prompt_ids[0]])).logits[0, -1] / TEMP, -1)[EOS]
    # ratio 1: the value is -A; the gradient is -A * grad log p(EOS), non-zero
    assert close(stats["loss"], -2.0)
    _, want, _ = oracle_grads(policy, one, acfg, temperature=TEMP, max_len=MAX_LEN, mask_truncated=True)
    assert_grads_close(grads, want)
    assert float(grads["lm_head.weight"][EOS].abs().sum()) > 0 and float(logp) < 0


class _BehindRuntime(CaptureRuntime):
    """This rank of two, with fewer micro-batches than the other (which has ``extra`` more): it runs idle ones."""

    def __init__(self, model, extra):
        super().__init__(model)
        self.extra, self.announced = extra, None

    def gather(self, n):
        return [n, n + self.extra]

    def expect_backwards(self, n):
        self.announced = n


def test_a_rank_with_fewer_micro_batches_runs_idle_ones_through_the_same_path(setup, monkeypatch):
    """ZeRO-2/3 needs every rank in every forward/backward: the rank behind runs one-token idle micro-batches with
    the real ones' engine settings, and they change neither its log-probs, its loss nor its gradient."""
    import grpo.engine.batch_logprobs
    import grpo.update
    from grpo.engine.batch_logprobs import nested_logprobs
    from grpo.update import UpdateSettings, policy_update

    policy, batch, old, ref = setup
    b = dataclasses.replace(batch, old_logps=nest_like(batch, old), ref_logps=nest_like(batch, ref))
    engine = EngineConfig(shared_prefix=False, max_tokens_per_micro_batch=16, attention_kernel="grouped")
    calls, real = [], grpo.update.token_logprobs

    def spy(model, prompts, comps, **kw):
        calls.append((prompts, comps, kw))
        return real(model, prompts, comps, **kw)

    monkeypatch.setattr(grpo.update, "token_logprobs", spy)
    monkeypatch.setattr(grpo.engine.batch_logprobs, "token_logprobs", spy)  # the old/reference passes' forwards
    alone = nested_logprobs(CaptureRuntime(policy), policy, b, engine, TEMP)
    n = len(calls)
    behind = nested_logprobs(_BehindRuntime(policy, 2), policy, b, engine, TEMP)
    idle = [c for c in calls[n:] if c[0] == [[0]]]
    assert len(calls) - n == n + 2 and len(idle) == 2
    assert all(c[1] == [[[0]]] and c[2] == {"shared_prefix": False, "temperature": TEMP, "attention_kernel": "grouped"}
               for c in idle)
    assert all(torch.equal(x, y) for ga, gb in zip(alone, behind) for x, y in zip(ga, gb))

    settings = UpdateSettings(_algo(), engine, temperature=TEMP, max_len=MAX_LEN, mask_truncated=False,
                              max_grad_norm=1.0)
    one = CaptureRuntime(policy)
    want = policy_update(one, b, settings)
    rt = _BehindRuntime(policy, 3)
    calls.clear()
    got = policy_update(rt, b, settings)
    idle = [c for c in calls if c[0] == [[0]]]
    assert rt.announced == len(calls) == len(idle) + len(_plan_of(b, engine)) and len(idle) == 3
    assert all(c[2] == {"shared_prefix": False, "temperature": TEMP, "return_entropy": True,
                        "attention_kernel": "grouped"} for c in calls)  # the real micro-batches' and the idle ones
    for k in ("loss", "entropy", "kl", "ratio_mean", "clip_ratio"):  # an idle token weighs nothing, counts nowhere
        assert got[k] == pytest.approx(want[k], rel=1e-6, abs=1e-9), k
    assert_grads_close(rt.grads, one.grads)


def _plan_of(batch, engine):
    from grpo.engine.batch_logprobs import plan as _plan

    return _plan(batch, engine)


class _StepRuntime(CaptureRuntime):
    """CaptureRuntime whose optimizer step reports a gradient norm and whether it stepped."""

    def __init__(self, model, stepped):
        super().__init__(model)
        self.stepped, self.asked = stepped, []

    def step(self, max_grad_norm):
        self.asked.append(max_grad_norm)
        super().step(max_grad_norm)
        return 1.25, self.stepped


@pytest.mark.parametrize("stepped", [True, False])
def test_the_metrics_are_means_over_the_loss_tokens(setup, stepped):
    """Entropy of softmax(logits / T) and the ratio pi / pi_old, each the mean over every completion token (a plain
    forward of each sequence computes them here); the clip fractions add up; the step's norm and outcome."""
    from grpo.update import UpdateSettings, policy_update

    policy, batch, old, _ = setup
    b = dataclasses.replace(batch, old_logps=nest_like(batch, old))
    rt = _StepRuntime(policy, stepped)
    settings = UpdateSettings(_algo(beta=0.0), SPLIT, temperature=TEMP, max_len=MAX_LEN, mask_truncated=False,
                              max_grad_norm=0.5)
    stats = policy_update(rt, b, settings)
    assert rt.asked == [0.5] and stats["grad_norm"] == 1.25 and stats["skipped"] is (not stepped)
    assert stats["empty_batch"] is False
    entropies, ratios = [], []
    with torch.no_grad():
        for g, (p, comps) in enumerate(zip(b.prompt_ids, b.completion_ids)):
            for j, c in enumerate(comps):
                logits = policy(torch.tensor([p + c])).logits[0, len(p) - 1:len(p) + len(c) - 1].float() / TEMP
                lp = logits.log_softmax(-1)
                entropies.append(-(lp.exp() * lp).sum(-1))
                ratios.append(torch.exp(lp.gather(-1, torch.tensor(c)[:, None])[:, 0] - b.old_logps[g][j]))
    assert stats["entropy"] == pytest.approx(float(torch.cat(entropies).mean()), rel=1e-4)
    assert stats["ratio_mean"] == pytest.approx(float(torch.cat(ratios).mean()), rel=1e-4)
    low, high = stats["clip_ratio_low"], stats["clip_ratio_high"]
    assert 0 < low < 1 and 0 < high < 1 and stats["clip_ratio"] == pytest.approx(low + high)


def test_one_token_and_a_policy_loss_without_statistics(setup, monkeypatch):
    """One loss token: the means divide by 1 (one pass: the ratio is exactly 1). A registered policy loss that
    reports no clip fractions or ratio gets None for them."""
    import grpo.algorithm.policy_loss as pl
    from grpo.batch import Batch
    from grpo.update import UpdateSettings, policy_update

    policy = setup[0]
    one = Batch([{}], [[5, 6]], [[[7]]], [[False]], torch.zeros(1), torch.tensor([1.0]))
    settings = UpdateSettings(_algo(beta=0.0), SPLIT, temperature=TEMP, max_len=MAX_LEN, mask_truncated=False,
                              max_grad_norm=1.0)
    assert policy_update(CaptureRuntime(policy), one, settings)["ratio_mean"] == 1.0
    monkeypatch.setitem(pl.POLICY_LOSSES._items, "plain", lambda logp, old, adv, mask, a: (-adv[:, None] * logp, {}))
    stats = policy_update(CaptureRuntime(policy), one, dataclasses.replace(settings, algorithm=_algo(
        beta=0.0, policy_loss="plain")))
    assert stats["clip_ratio_low"] is None and stats["clip_ratio"] is None and stats["ratio_mean"] is None
    calls = []  # the loss the run resolved once (`derive`) is the one each micro-batch runs: no lookup by name
    monkeypatch.setattr(pl, "get_policy_loss", lambda spec: pytest.fail(f"looked up {spec!r} again"))
    resolved = dataclasses.replace(settings, policy_loss=lambda *a: calls.append(1) or (-a[2][:, None] * a[0], {}))
    assert policy_update(CaptureRuntime(policy), one, resolved)["ratio_mean"] is None and calls


def test_with_the_kl_in_the_reward_the_loss_has_no_kl_term(setup):
    """algorithm.kl_in_reward: the KL was paid in the reward (grpo.experience), the update adds none."""
    from grpo.batch import Batch
    from grpo.update import UpdateSettings, policy_update

    policy = setup[0]
    one = Batch([{}], [[5, 6]], [[[7, 8]]], [[False]], torch.zeros(1), torch.tensor([1.0]),
                ref_logps=[[torch.tensor([-9.0, -9.0])]])  # far from the policy: a large KL
    settings = UpdateSettings(_algo(beta=0.5, kl_in_reward=True), SPLIT, temperature=TEMP, max_len=MAX_LEN,
                              mask_truncated=False, max_grad_norm=1.0)
    with_ref = policy_update(CaptureRuntime(policy), one, settings)
    without = policy_update(CaptureRuntime(policy), dataclasses.replace(one, ref_logps=None), settings)
    assert "kl" not in with_ref and with_ref["loss"] == pytest.approx(without["loss"], rel=1e-6)


def test_a_multi_turn_batch_on_a_rank_behind_runs_idle_micro_batches(setup):
    """Tool tokens (completion_masks) out of the loss on a rank with fewer micro-batches than another: its idle
    micro-batches take no mask of a real completion, and the loss, metrics and gradient are those of one rank."""
    from grpo.update import UpdateSettings, policy_update

    policy, batch, old, ref = setup
    masks = [[[k % 3 != 1 for k in range(len(c))] for c in g] for g in batch.completion_ids]
    b = dataclasses.replace(batch, old_logps=nest_like(batch, old), ref_logps=nest_like(batch, ref),
                            completion_masks=masks)
    settings = UpdateSettings(_algo(), SPLIT, temperature=TEMP, max_len=MAX_LEN, mask_truncated=False,
                              max_grad_norm=1.0)
    one = CaptureRuntime(policy)
    want = policy_update(one, b, settings)
    plain = policy_update(CaptureRuntime(policy), dataclasses.replace(b, completion_masks=None), settings)
    assert want["loss"] != pytest.approx(plain["loss"], rel=1e-3)  # the tool tokens are out of the loss
    rt = _BehindRuntime(policy, 2)
    got = policy_update(rt, b, settings)
    assert rt.announced == len(_plan_of(b, SPLIT)) + 2
    for k in ("loss", "entropy", "kl", "ratio_mean", "clip_ratio"):
        assert got[k] == pytest.approx(want[k], rel=1e-6, abs=1e-9), k
    assert_grads_close(rt.grads, one.grads)
