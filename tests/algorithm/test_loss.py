import math

import pytest
import torch

from grpo.algorithm.aggregation import BatchCounts, token_weights
from grpo.algorithm.kl import kl_estimate
from grpo.algorithm.loss import grpo_loss, pad
from grpo.algorithm.policy_loss import importance_ratio


def test_kl_estimators_hand_computed():
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    d = ref - logp  # log(pi_ref / pi)
    assert torch.allclose(kl_estimate(logp, ref, "k1"), -d)
    assert torch.allclose(kl_estimate(logp, ref, "k2"), 0.5 * d ** 2)
    assert torch.allclose(kl_estimate(logp, ref, "k3"), torch.exp(d) - d - 1)
    assert (kl_estimate(torch.randn(100), torch.randn(100), "k3") >= 0).all()
    assert torch.equal(kl_estimate(logp, logp, "k3"), torch.zeros(2))


def test_loss_against_hand_computed_example():
    # two sequences: lengths 2 and 1; ratio moved away from 1 on some tokens
    logp = torch.tensor([[-1.0, -0.5], [-2.0, 0.0]], requires_grad=True)
    old = torch.tensor([[-1.2, -0.5], [-1.5, 0.0]])
    ref = torch.tensor([[-1.1, -0.7], [-2.0, 0.0]])
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    counts = BatchCounts(num_seqs=2, num_tokens=3, max_len=4)
    w = token_weights(mask, "seq_mean_token_mean", counts)
    loss, stats = grpo_loss(logp, old, ref, adv, mask, w, beta=0.1, epsilon=0.2)
    # by hand
    r00 = math.exp(0.2)            # > 1.2 -> clipped at 1.2 for A=+1
    t00 = -min(r00 * 1, 1.2 * 1)
    t01 = -1.0                     # ratio 1
    r10 = math.exp(-0.5)           # < 0.8 with A=-2 -> min(r*A, 0.8*A) = r*A? r*A=-1.213, 0.8*A=-1.6 -> -1.6
    t10 = -min(r10 * -2, 0.8 * -2)
    k = lambda lp, rf: math.exp(rf - lp) - (rf - lp) - 1  # noqa: E731
    t00 += 0.1 * k(-1.0, -1.1)
    t01 += 0.1 * k(-0.5, -0.7)
    t10 += 0.1 * k(-2.0, -2.0)
    expected = 0.5 * ((t00 + t01) / 2) + 0.5 * t10
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert stats["clip_high"].item() == 1 and stats["clip_low"].item() == 1
    loss.backward()
    # the clipped token (0,0) gets only the KL gradient
    kl_grad = 0.1 * (1 - math.exp(-1.1 + 1.0)) * 0.25
    assert logp.grad[0, 0].item() == pytest.approx(kl_grad, rel=1e-5)


def test_ratio_one_with_single_iteration_gives_minus_mean_advantage():
    logp = torch.randn(3, 5, requires_grad=True)
    adv = torch.tensor([1.0, -1.0, 0.5])
    mask = torch.ones(3, 5)
    w = token_weights(mask, "token_mean", BatchCounts(3, 15, 5))
    loss, _ = grpo_loss(logp, None, None, adv, mask, w)
    assert loss.item() == pytest.approx(-adv.mean().item(), rel=1e-6)
    loss.backward()
    assert torch.allclose(logp.grad, (-adv[:, None] / 15).expand(3, 5))


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "dr_grpo"])
def test_aggregations_hand_computed_and_invariant_to_micro_batching(agg):
    torch.manual_seed(0)
    lengths = [3, 1, 4, 2]
    per_token = [torch.randn(n) for n in lengths]
    x, mask = pad(per_token)
    counts = BatchCounts(num_seqs=4, num_tokens=sum(lengths), max_len=6)
    full = (x * token_weights(mask, agg, counts)).sum()
    expected = {
        "token_mean": sum(t.sum() for t in per_token) / 10,
        "seq_mean_token_mean": sum(t.mean() for t in per_token) / 4,
        "seq_mean_token_sum": sum(t.sum() for t in per_token) / 4,
        "dr_grpo": sum(t.sum() for t in per_token) / (4 * 6),
    }[agg]
    assert full.item() == pytest.approx(expected.item(), rel=1e-6)
    # micro-batches of 1 and 3 sequences, batch-wide counts: the sum is the same loss
    parts = 0.0
    for chunk in ([0], [1, 2, 3]):
        xs, m = pad([per_token[i] for i in chunk])
        parts += (xs * token_weights(m, agg, counts)).sum()
    assert parts.item() == pytest.approx(full.item(), rel=1e-6)


def test_clip_higher_and_delta():
    logp = torch.log(torch.tensor([[1.25, 3.0]]))
    old = torch.zeros(1, 2)
    mask, w = torch.ones(1, 2), torch.ones(1, 2)
    pos = torch.tensor([1.0])
    loss, _ = grpo_loss(logp, old, None, pos, mask, w, epsilon=0.2, epsilon_high=0.28)
    assert loss.item() == pytest.approx(-(1.25 + 1.28), rel=1e-6)  # 1.25 unclipped, 3.0 capped at 1.28
    neg = torch.tensor([-1.0])
    loss, _ = grpo_loss(logp, old, None, neg, mask, w, epsilon=0.2, delta=2.0)
    assert loss.item() == pytest.approx(1.25 + 2.0, rel=1e-6)  # ratio 3.0 capped at delta=2


def test_sequence_level_importance_ratio():
    logp = torch.tensor([[0.2, 0.4, 9.0]])
    old = torch.zeros(1, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    r = importance_ratio(logp, old, mask, "sequence")
    assert torch.allclose(r, torch.full((1, 3), math.exp(0.3)))


def test_delta_below_one_plus_epsilon_high_would_zero_the_gradient_so_config_refuses_it(cfg_factory):
    from grpo.config.schema import ConfigError

    # ratio 1.2, A = +1, epsilon_high 0.28: the gradient wrt log pi is -1.2 (unclipped) ...
    logp = torch.log(torch.tensor([[1.2]])).requires_grad_()
    args = (logp, torch.zeros(1, 1), None, torch.tensor([1.0]), torch.ones(1, 1), torch.ones(1, 1))
    grpo_loss(*args, epsilon=0.2, epsilon_high=0.28, delta=1.28)[0].backward()
    assert logp.grad.item() == pytest.approx(-1.2, rel=1e-6)
    # ... but delta 1.1 caps the unclipped term at 1.1 < 1.2: min picks the constant, the gradient is 0
    logp.grad = None
    grpo_loss(*args, epsilon=0.2, epsilon_high=0.28, delta=1.1)[0].backward()
    assert logp.grad.item() == 0.0
    with pytest.raises(ConfigError) as e:
        cfg_factory({"algorithm": {"delta": 1.1, "epsilon_high": 0.28}})
    msg = str(e.value)
    assert msg.startswith("algorithm.delta=1.1 must be >= 1 + epsilon_high = 1.28 or null") and "\n" not in msg
    with pytest.raises(ConfigError, match=r"algorithm.delta=1.15 must be >= 1 \+ epsilon_high = 1.2 "):
        cfg_factory({"algorithm": {"delta": 1.15}})  # epsilon_high null: epsilon (0.2) is the upper clip
    assert cfg_factory({"algorithm": {"delta": 1.28, "epsilon_high": 0.28}}).algorithm.delta == 1.28
    assert cfg_factory({"algorithm": {"delta": 1.2}}).algorithm.delta == 1.2


def test_the_keyword_form_adds_no_kl_unless_beta_is_given():
    """grpo_loss's beta defaults to 0 (not AlgorithmConfig's): a reference passed without beta changes nothing."""
    logp = torch.tensor([[-1.0, -0.5]], requires_grad=True)
    ref, adv, mask = torch.tensor([[-1.5, -0.2]]), torch.tensor([1.0]), torch.ones(1, 2)
    w = token_weights(mask, "token_mean", BatchCounts(1, 2, 2))
    plain, stats = grpo_loss(logp, None, ref, adv, mask, w)
    assert plain.item() == pytest.approx(-1.0) and "kl" not in stats
    with_kl, stats = grpo_loss(logp, None, ref, adv, mask, w, beta=0.5)
    assert with_kl.item() > plain.item() and "kl" in stats


def test_pad_right_pads_with_zeros_or_the_given_value_and_masks_the_padding():
    padded, mask = pad([torch.tensor([1.0, 2.0]), torch.tensor([3.0])])
    assert padded.tolist() == [[1.0, 2.0], [3.0, 0.0]] and mask.tolist() == [[1.0, 1.0], [1.0, 0.0]]
    padded, _ = pad([torch.tensor([1.0, 2.0]), torch.tensor([3.0])], value=-1.0)
    assert padded.tolist() == [[1.0, 2.0], [3.0, -1.0]]


def test_the_kl_coefficient_has_one_name_beta():
    """``kl_coef`` (verl's name) is refused in one line naming ``beta``, in grpo_loss and in the config; with the KL in
    the reward the loss holds no KL term (beta is then applied to the reward, `grpo.experience.finish`)."""
    from grpo.algorithm.loss import objective
    from grpo.config.schema import AlgorithmConfig, ConfigError, load

    logp, ref = torch.tensor([[-1.0, -2.0]], requires_grad=True), torch.tensor([[-1.5, -1.0]])
    adv, mask, w = torch.tensor([1.0]), torch.ones(1, 2), torch.full((1, 2), 0.5)
    with pytest.raises(TypeError, match=r"^grpo_loss\(\) takes no kl_coef: the KL penalty's coefficient is beta "
                                        r"\(algorithm.beta\)$"):
        grpo_loss(logp, None, ref, adv, mask, w, kl_coef=0.1)
    with pytest.raises(ConfigError, match=r"^unknown config key 'algorithm.kl_coef' \(did you mean "
                                          r"'algorithm.beta'\?\)$"):
        load({"algorithm": {"kl_coef": 0.1}})
    in_loss, stats = objective(logp, None, ref, adv, mask, w, AlgorithmConfig(beta=0.5))
    in_reward, no_kl = objective(logp, None, ref, adv, mask, w, AlgorithmConfig(beta=0.5, kl_in_reward=True))
    plain, _ = objective(logp, None, ref, adv, mask, w, AlgorithmConfig(beta=0.0))
    assert "kl" in stats and "kl" not in no_kl and torch.equal(in_reward, plain) and not torch.equal(in_loss, plain)
