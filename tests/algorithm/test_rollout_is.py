"""Rollout importance sampling against a hand-computed example (no vLLM needed)."""
import math

import pytest
import torch

from grpo.algorithm.loss import grpo_loss
from grpo.algorithm.rollout_is import rollout_is, summarize


def rollout_is_weights(*args):
    return rollout_is(*args)[0]


def mismatch_stats(*args):
    return rollout_is(*args)[1]

# two completions: 3 tokens and 2 tokens (right-padded); log pi_old - log pi_sampler per token:
#   seq 0: ln 2, 0, ln 0.5 -> token ratios 2, 1, 0.5; sequence ratio 1
#   seq 1: ln 4, ln 1.5    -> token ratios 4, 1.5;    sequence ratio 6
LN = math.log
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, 0.0]])
SAMPLER = OLD - torch.tensor([[LN(2), 0.0, LN(0.5)], [LN(4), LN(1.5), 0.0]])
SAMPLER[1, 2] = -7.0  # padding: whatever is there must not count
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


@pytest.mark.parametrize("mode,cap,want", [
    ("none", 3.0, [[1, 1, 1], [1, 1, 0]]),
    ("token_truncate", 3.0, [[2, 1, 0.5], [3, 1.5, 0]]),
    ("token_mask", 3.0, [[2, 1, 0.5], [0, 1.5, 0]]),
    ("sequence_truncate", 3.0, [[1, 1, 1], [3, 3, 0]]),
    ("sequence_mask", 3.0, [[1, 1, 1], [0, 0, 0]]),
    ("sequence_mask", 10.0, [[1, 1, 1], [6, 6, 0]]),
    ("token_truncate", 1.0, [[1, 1, 0.5], [1, 1, 0]]),
])
def test_weights_hand_computed(mode, cap, want):
    w = rollout_is_weights(OLD, SAMPLER, MASK, mode, cap)
    assert torch.allclose(w, torch.tensor(want, dtype=torch.float32), atol=1e-5)
    assert not w.requires_grad


def test_weights_carry_no_gradient():
    logp = OLD.clone().requires_grad_(True)
    w = rollout_is_weights(logp, SAMPLER, MASK, "token_truncate", 3.0)
    assert not w.requires_grad


def test_mismatch_stats_hand_computed():
    s = mismatch_stats(OLD, SAMPLER, MASK, "token_truncate", 3.0)
    assert s["tokens"] == 5
    assert s["abs_diff"] == pytest.approx(LN(2) + 0 + LN(2) + LN(4) + LN(1.5))
    assert s["ratio_max"] == pytest.approx(4.0)
    assert s["abs_diff_max"] == pytest.approx(LN(4))
    assert s["capped"] == 1  # the token with ratio 4
    seq = mismatch_stats(OLD, SAMPLER, MASK, "sequence_mask", 3.0)
    assert seq["ratio_max"] == pytest.approx(6.0) and seq["capped"] == 2  # both tokens of completion 1
    assert mismatch_stats(OLD, SAMPLER, MASK, "none", 3.0)["capped"] == 0
    m = summarize(s)
    assert m["rollout_is/logp_diff_abs_mean"] == pytest.approx(s["abs_diff"] / 5)
    assert m["rollout_is/capped_frac"] == pytest.approx(0.2) and m["rollout_is/ratio_max"] == pytest.approx(4.0)


def test_unknown_mode_is_an_error():
    with pytest.raises(ValueError, match="rollout_is"):
        rollout_is_weights(OLD, SAMPLER, MASK, "tis", 2.0)


def test_loss_multiplies_only_the_policy_term():
    """With one iteration (ratio 1, no clipping) the per-token policy loss is -A * w; the KL term is unweighted."""
    logp = OLD.clone().requires_grad_(True)
    ref = OLD - 0.1
    adv = torch.tensor([1.0, -2.0])
    weights = MASK / MASK.sum()
    w = rollout_is_weights(OLD, SAMPLER, MASK, "token_truncate", 3.0)
    loss, _ = grpo_loss(logp, None, ref, adv, MASK, weights, beta=0.5, rollout_weights=w)
    base, _ = grpo_loss(logp, None, ref, adv, MASK, weights, beta=0.5)
    kl = (torch.exp(ref - OLD) - (ref - OLD) - 1)
    want = ((-adv[:, None] * w + 0.5 * kl) * weights).sum()
    assert float(loss.detach()) == pytest.approx(float(want), rel=1e-6)
    assert float(base.detach()) == pytest.approx(float(((-adv[:, None] + 0.5 * kl) * weights).sum()), rel=1e-6)
    # gradient of the policy term: d/dlogp (-A * w * exp(logp - logp.detach())) = -A * w per token
    g, = torch.autograd.grad(loss, logp)
    dkl = 0.5 * (1 - torch.exp(ref - OLD))
    assert torch.allclose(g, (-adv[:, None] * w + dkl) * weights, atol=1e-6)


def test_meter_sums_by_all_reduce_and_maxes_by_all_max():
    """Two ranks seen through the runtime interface: sums add up, maxima take the larger one (the one-process
    base class returns its input)."""
    from grpo.algorithm.rollout_is import MismatchMeter
    from grpo.runtime.base import Runtime

    class TwoRanks(Runtime):  # the other rank measured half the difference and a ratio of 10
        def all_reduce(self, values):
            return {k: 2 * v for k, v in values.items()}

        def all_max(self, values):
            return {k: max(v, {"ratio_max": 10.0, "abs_diff_max": 0.0}[k]) for k, v in values.items()}

    meter = MismatchMeter("token_truncate", 2.0)
    w = meter.weights(OLD, SAMPLER, MASK)
    assert torch.equal(w, rollout_is_weights(OLD, SAMPLER, MASK, "token_truncate", 2.0))
    one = meter.metrics(Runtime(), Runtime().all_reduce(meter.sums))  # the update adds sums to its all-reduced totals
    assert one == summarize(mismatch_stats(OLD, SAMPLER, MASK, "token_truncate", 2.0))
    two = meter.metrics(TwoRanks(), TwoRanks().all_reduce(meter.sums))
    assert two["rollout_is/ratio_max"] == 10.0
    assert two["rollout_is/logp_diff_abs_max"] == one["rollout_is/logp_diff_abs_max"]
    assert two["rollout_is/logp_diff_abs_mean"] == pytest.approx(one["rollout_is/logp_diff_abs_mean"])


def _update_with_sampler(policy, batch, old, sampling, mode="token_truncate", cap=100.0):
    """policy_update as a second pass of num_iterations > 1 runs it: old log-probs from before the first optimizer
    step (not the current policy's), the sampler's own log-probs (vLLM's), the optimizer step captured."""
    import dataclasses

    from grpo.config.schema import AlgorithmConfig, EngineConfig
    from grpo.update import UpdateSettings, policy_update
    from tests.test_update import CaptureRuntime

    b = dataclasses.replace(batch, old_logps=old, sampling_logps=sampling)
    rt = CaptureRuntime(policy)
    settings = UpdateSettings(AlgorithmConfig(num_iterations=2, beta=0.0, epsilon=10.0), EngineConfig(),
                              temperature=1.0, max_len=8, mask_truncated=False, max_grad_norm=0.0, rollout_is=mode,
                              rollout_is_cap=cap)
    return policy_update(rt, b, settings), rt.grads


def test_importance_weights_use_the_old_policy_not_the_current_one():
    """From the second pass on the current log-probs differ from pi_old: rho = pi_old / pi_sampler (vLLM with
    num_iterations > 1). A sampler that agrees with pi_old exactly gives weights of 1 (the uncorrected gradient);
    the measured mismatch is |log pi_old - log pi_sampler|, whatever the current policy is. Runs without vLLM: the
    update only sees the sampler's log-probs in the batch."""
    from grpo.batch import Batch
    from grpo.engine.batch_logprobs import nested_logprobs
    from grpo.models import tiny_model
    from tests.test_update import CaptureRuntime

    policy = tiny_model("llama", 50, seed=0)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 50, (n,), generator=gen).tolist() for n in (5, 3)]
    comps = [[torch.randint(3, 50, (n,), generator=gen).tolist() for n in g] for g in ([4, 2], [3, 5])]
    batch = Batch([{}, {}], prompts, comps, [[False, False], [False, False]], torch.zeros(4),
                  torch.tensor([1.0, -1.0, 0.5, -0.5]))
    from grpo.config.schema import EngineConfig

    current = nested_logprobs(CaptureRuntime(policy), policy, batch, EngineConfig(), 1.0)
    old = [[lp - 0.3 * torch.randn(lp.shape, generator=gen) for lp in g] for g in current]  # the policy moved since
    plain, want = _update_with_sampler(policy, batch, old, None)
    same, got = _update_with_sampler(policy, batch, old, [[lp.clone() for lp in g] for g in old])
    assert same["rollout_is/logp_diff_abs_mean"] == 0.0 and same["rollout_is/ratio_max"] == pytest.approx(1.0)
    assert all(torch.allclose(got[n], want[n], atol=1e-6) for n in want)  # weights of exactly 1
    assert same["loss"] == pytest.approx(plain["loss"], rel=1e-5)
    sampler = [[lp - 0.25 for lp in g] for g in old]  # pi_old / pi_sampler = e^0.25 on every token
    shifted, _ = _update_with_sampler(policy, batch, old, sampler)
    assert shifted["rollout_is/logp_diff_abs_mean"] == pytest.approx(0.25, abs=1e-6)
    assert shifted["rollout_is/ratio_max"] == pytest.approx(math.exp(0.25), rel=1e-5)
    assert shifted["loss"] == pytest.approx(plain["loss"] * math.exp(0.25), rel=1e-4)  # every token weighted alike


def test_meter_reports_a_ratio_max_below_one():
    """Every token less likely under pi_old than under the sampler: the largest ratio is below 1 (the meter's start
    value must not be 1)."""
    from grpo.algorithm.rollout_is import MismatchMeter
    from grpo.runtime.base import Runtime

    meter = MismatchMeter("token_truncate", 2.0)
    meter.weights(SAMPLER - 0.5, SAMPLER, MASK)  # rho = e^-0.5 on every token
    out = meter.metrics(Runtime(), meter.sums)
    assert out["rollout_is/ratio_max"] == pytest.approx(math.exp(-0.5))
    assert out["rollout_is/logp_diff_abs_max"] == pytest.approx(0.5)


def test_summarize_of_nothing_and_of_one_token():
    """No correction measured (every key missing): zeros, not an error; one token: its own difference."""
    assert summarize({}) == {"rollout_is/logp_diff_abs_mean": 0.0, "rollout_is/logp_diff_abs_max": 0.0,
                             "rollout_is/ratio_max": 0.0, "rollout_is/capped_frac": 0.0}
    one = summarize({"abs_diff": 0.5, "tokens": 1.0, "capped": 1.0, "ratio_max": 3.0, "abs_diff_max": 0.5})
    assert one["rollout_is/logp_diff_abs_mean"] == 0.5 and one["rollout_is/capped_frac"] == 1.0
    assert one["rollout_is/logp_diff_abs_max"] == 0.5 and one["rollout_is/ratio_max"] == 3.0


def test_meter_weights_come_in_the_log_probs_dtype():
    from grpo.algorithm.rollout_is import MismatchMeter

    w = MismatchMeter("token_truncate", 2.0).weights(OLD.bfloat16(), SAMPLER.bfloat16(), MASK)
    assert w.dtype == torch.bfloat16


def test_a_ratio_exactly_at_the_cap_is_kept_and_nothing_masked_gives_zeros():
    """token_mask keeps a ratio equal to the cap (drops only those above it) and does not count it as capped; with
    every token masked the maxima are 0 (not 1, not an error)."""
    logp = torch.tensor([[math.log(2.0), 0.0]])
    sampler, mask = torch.zeros(1, 2), torch.ones(1, 2)
    w, stats = rollout_is(logp, sampler, mask, "token_mask", 2.0)
    assert torch.allclose(w, torch.tensor([[2.0, 1.0]])) and stats["capped"] == 0.0
    w, stats = rollout_is(logp, sampler, torch.zeros(1, 2), "token_truncate", 2.0)
    assert torch.equal(w, torch.zeros(1, 2)) and stats["ratio_max"] == 0.0 and stats["abs_diff_max"] == 0.0
    w, stats = rollout_is(torch.zeros(0, 0), torch.zeros(0, 0), torch.zeros(0, 0), "token_truncate", 2.0)
    assert w.shape == (0, 0) and stats["ratio_max"] == 0.0 and stats["abs_diff_max"] == 0.0
